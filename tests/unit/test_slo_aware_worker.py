"""A worker's slo_aware: its flags and env vars, and the performance model its table starts from
(the emulated engine's own; a fitted model's with --perf-model)."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.config import WorkerConfig, load_config
from splitserve.core import SamplingParams, SloAwarePolicy, StageSlo, StageSpec
from splitserve.perf.presets import preset
from workers.engine.config import EngineConfig
from workers.engine.emulated import EmulatedEngine, Emulation, StepPacer
from workers.server import engine_config_from


class VirtualTime:
    """The emulated pass's sleep advances this clock instead of waiting: every step then
    measures exactly its model time, whatever the machine's load (no wall clock in the test)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def now(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += max(0.0, seconds)


def emulated(config: EngineConfig, emulation: Emulation = Emulation("A100", "Qwen2.5-14B",
                                                                                 perf_backend="datasheet")) -> EmulatedEngine:
    time_ = VirtualTime()
    pacer = StepPacer(clock=time_.now, sleep=time_.sleep, cpu_clock=time_.now)
    return EmulatedEngine(config, emulation, clock=time_.now, pacer=pacer)


def test_flags_and_env_vars_reach_the_engine_config(tmp_path):
    fitted = dataclasses.replace(preset("A100", "Qwen2.5-14B"), label="fitted")
    path = tmp_path / "perf.json"
    fitted.save(path)
    config = load_config(WorkerConfig, environ={
        "SPLITSERVE_WORKER_BATCH_POLICY": "slo_aware", "SPLITSERVE_WORKER_ITL_SLO_MS": "80",
        "SPLITSERVE_WORKER_BATCH_POLICY_OPTIONS": '{"target_fraction": 0.85, "min_prefill_tokens": 32}',
        "SPLITSERVE_WORKER_PERF_MODEL": str(path)})
    engine_config = engine_config_from(config)
    assert engine_config.batch_policy == "slo_aware" and engine_config.perf_model == str(path)
    assert engine_config.batch_policy_options == {"target_fraction": 0.85, "min_prefill_tokens": 32, "itl_slo_ms": 80.0}
    engine = emulated(engine_config)
    policy = engine.scheduler.policy
    assert isinstance(policy, SloAwarePolicy) and policy.table.prior_label == "fitted"
    assert (policy.default_itl_slo_s, policy.target_fraction, policy.min_prefill_tokens) == (0.08, 0.85, 32)


@pytest.mark.parametrize("fields,message", [
    ({"batch_policy_options": "{"}, "batch_policy_options: not JSON"),
    ({"batch_policy_options": "[1]"}, "batch_policy_options must be a JSON object"),
    ({"itl_slo_ms": 100.0}, "itl_slo_ms: batch policy 'fcfs' takes no ITL objective"),
    ({"batch_policy": "slo_aware", "itl_slo_ms": -1.0}, "itl_slo_ms must be >= 0"),
    ({"batch_policy": "slo_aware", "itl_slo_ms": 50.0, "batch_policy_options": '{"itl_slo_ms": 60}'},
     "itl_slo_ms is given twice"),
])
def test_bad_worker_options_name_the_flag(fields, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from(WorkerConfig(**fields))


def test_the_engine_config_checks_the_policy_before_anything_is_loaded(tmp_path):
    with pytest.raises(ValueError, match="bad options for batch policy 'slo_aware': target_fraction"):
        EngineConfig(model="nowhere", batch_policy="slo_aware", batch_policy_options={"target_fraction": 3}).validate()
    with pytest.raises(ValueError, match="unknown batch policy 'nope'"):
        EngineConfig(model="nowhere", batch_policy="nope").validate()
    with pytest.raises(ValueError, match="perf_model: .* is not a file"):
        EngineConfig(model="nowhere", perf_model=str(tmp_path / "missing.json")).validate()


def test_an_emulated_worker_starts_from_its_own_model_and_learns_from_its_steps():
    engine = emulated(EngineConfig(model="", batch_policy="slo_aware"))
    policy = engine.scheduler.policy
    assert policy.table.prior_label == engine.perf_model.label  # the preset the worker emulates
    for i in range(12):
        engine.add_stage(StageSpec.whole(f"r{i}", list(range(5, 205)), SamplingParams(max_tokens=20),
                                         slo=StageSlo(itl_s=0.05)))
    engine.add_stage(StageSpec.whole("long", list(range(5, 4005)), SamplingParams(max_tokens=2),
                                     slo=StageSlo(itl_s=0.05)))
    shapes = []
    while engine.has_unfinished():
        engine.step()
        shapes.append(engine.last_output.shape)
    assert policy.table.num_observations == len(shapes)
    mixed = [s for s in shapes if s.num_decodes and s.prefill_chunks]
    assert mixed and all(s.num_prefill_tokens <= 2048 - s.num_decodes for s in mixed)
    # The long prompt is chunked beside the decodes to what 90% of 50 ms leaves.
    assert max(engine.runner.perf.step_time(s.prefill_chunks, s.num_decodes, s.mean_decode_context)
               for s in mixed) <= 0.045 * 1.01


def test_fcfs_workers_are_unchanged():
    engine = emulated(EngineConfig(model=""))
    assert engine.scheduler.policy.name == "fcfs"
