"""The real DiffusionEngine over the emulated runner (workers/diffusion/emulated.py): LLaDA-8B
steps timed by the datasheet roofline on a virtual clock, no weights, no sleeping."""

from __future__ import annotations

import pytest

from splitserve.core import SamplingParams, StageKey
from splitserve.core.diffusion_perf import DiffusionPerfModel
from workers.diffusion.emulated import (LLADA_EOS_TOKEN_IDS, LLADA_MASK_TOKEN_ID, ORDINARY_TOKEN_LIMIT,
                                        DiffusionEmulation, VirtualClock, build_emulated_diffusion_engine,
                                        dllm_serve_config, static_baseline_config)

GEN, BLOCK, STEPS = 64, 16, 32  # four blocks of eight steps: two tokens unmasked per step


def _params(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=GEN, block_length=BLOCK, steps=STEPS, temperature=0.0, **extra)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (salt + i) % 5000 for i in range(n)]


def _drain(engine, clock: VirtualClock) -> tuple[dict, dict, dict]:
    """Step to the end; per request its events (time, tokens, reason) and completion time."""
    events: dict[str, list] = {}
    done: dict[str, float] = {}
    steps = 0
    while engine.has_unfinished():
        before = clock.now
        for event in engine.step():
            events.setdefault(event.key.request_id, []).append((clock.now, list(event.token_ids), event.finish_reason))
            if event.finish_reason:
                done[event.key.request_id] = clock.now
        assert clock.now > before  # every step advances the virtual clock by its modelled time
        steps += 1
        assert steps < 100_000
    return events, done, {"steps": steps}


def test_requests_run_to_completion_block_by_block_on_the_virtual_clock():
    clock = VirtualClock()
    emulation = DiffusionEmulation("RTX4090")
    config, plan = dllm_serve_config(emulation, max_num_batched_tokens=4000)
    engine = build_emulated_diffusion_engine(config, emulation, clock)
    assert engine.scheduler.config.kv_capacity_tokens == plan.kv_capacity_tokens > 0
    lengths = [40, 300, 900]
    for i, n in enumerate(lengths):
        engine.add_request(StageKey(str(i)), _prompt(n, i), _params())
    events, done, _ = _drain(engine, clock)
    assert sorted(done) == ["0", "1", "2"]
    for evs in events.values():
        assert len(evs) == GEN // BLOCK  # one event per block, when the block is final
        assert all(len(tokens) == BLOCK for _, tokens, _ in evs)
        assert [reason for *_, reason in evs] == [None] * (GEN // BLOCK - 1) + ["length"]
        assert [t for t, *_ in evs] == sorted(t for t, *_ in evs)
        output = [tok for _, tokens, _ in evs for tok in tokens]
        assert all(0 <= tok < ORDINARY_TOKEN_LIMIT for tok in output)  # no EOS, no mask token
        assert not set(output) & (LLADA_EOS_TOKEN_IDS | {LLADA_MASK_TOKEN_ID})
    # The busy time is the sum of the modelled steps: the clock never moved otherwise.
    assert clock.now == pytest.approx(engine.runner.stats.busy_s)
    assert engine.runner.stats.refresh_entries == len(lengths) * GEN // BLOCK  # one Refresh per block
    assert engine.runner.stats.peak_logit_rows <= config.max_num_logits


def test_outputs_are_deterministic_and_independent_of_batching():
    def run(batched: bool) -> list[int]:
        clock = VirtualClock()
        emulation = DiffusionEmulation("L40S")
        config, _ = dllm_serve_config(emulation, max_num_batched_tokens=16384)
        engine = build_emulated_diffusion_engine(config, emulation, clock)
        engine.add_request(StageKey("a"), _prompt(50), _params(seed=7))
        if batched:
            engine.add_request(StageKey("b"), _prompt(70, 3), _params(seed=8))
        events, _, _ = _drain(engine, clock)
        return [tok for _, tokens, _ in events["a"] for tok in tokens]

    assert run(False) == run(True)


def test_the_static_baseline_is_sized_by_its_refresh_peak():
    emulation = DiffusionEmulation("RTX4090", logit_decomposition=False, pad_to_longest=True)
    config, plan = static_baseline_config(emulation, 1280)
    perf = DiffusionPerfModel.preset("RTX4090", "LLaDA-8B")
    assert config.static_batch_size == plan.static_batch_size == perf.largest_static_batch(1280).static_batch_size
    assert config.max_num_batched_tokens == plan.static_batch_size * 1280
    engine = build_emulated_diffusion_engine(config, emulation, VirtualClock())
    assert engine.runner.full_sequence_logits and engine.runner.max_num_logits is None


@pytest.mark.parametrize("gpu", ["RTX4090", "L40S"])
def test_phase_multiplexed_finishes_a_burst_no_later_than_static(gpu):
    lengths = [60 + 37 * i for i in range(16)]
    max_len = max(lengths) + GEN

    def makespan(system: str) -> tuple[float, dict]:  # (the last completion, each request's)
        clock = VirtualClock()
        if system == "static":
            emulation = DiffusionEmulation(gpu, logit_decomposition=False, pad_to_longest=True)
            config, _ = static_baseline_config(emulation, max_len, block_length=BLOCK)
        else:
            emulation = DiffusionEmulation(gpu)
            config, _ = dllm_serve_config(emulation, max_num_batched_tokens=4000)
        engine = build_emulated_diffusion_engine(config, emulation, clock)
        for i, n in enumerate(lengths):
            engine.add_request(StageKey(str(i)), _prompt(n, i), _params())
        _, done, _ = _drain(engine, clock)
        assert len(done) == len(lengths)
        return clock.now, done

    static_end, _ = makespan("static")
    mux_end, _ = makespan("phase_multiplexed")
    assert mux_end <= static_end


# ---- issue 34: measured step times and Table 4's other baselines --------------------------------
def _run(emulation: DiffusionEmulation, config, lengths, **extra) -> tuple[VirtualClock, object]:
    clock = VirtualClock()
    engine = build_emulated_diffusion_engine(config, emulation, clock)
    for i, n in enumerate(lengths):
        engine.add_request(StageKey(str(i)), _prompt(n, i), _params(**extra))
    _, done, _ = _drain(engine, clock)
    assert len(done) == len(lengths)
    assert clock.now == pytest.approx(engine.runner.stats.busy_s)
    return clock, engine


def test_the_measured_backend_times_the_same_engine():
    pytest.importorskip("aiconfigurator_core")
    lengths = [40, 300, 900]
    ends = {}
    for backend in ("datasheet", "aiconfigurator"):
        emulation = DiffusionEmulation("L40S", perf_backend=backend)
        config, plan = dllm_serve_config(emulation, max_num_batched_tokens=16384)
        clock, engine = _run(emulation, config, lengths)
        assert engine.runner.perf.backend == backend
        assert engine.runner.last_cost.measured_s is None if backend == "datasheet" else \
            engine.runner.last_cost.measured_s > 0
        ends[backend] = clock.now
    assert ends["datasheet"] != ends["aiconfigurator"]
    assert 0.5 < ends["aiconfigurator"] / ends["datasheet"] < 2  # the same work, two timings


def test_auto_times_the_rtx4090_on_the_roofline_and_says_so():
    emulation = DiffusionEmulation("RTX4090", perf_backend="auto")
    perf = emulation.perf_model()
    assert perf.backend == "datasheet" and "not measured" in perf.describe() and perf.note


@pytest.mark.parametrize("gpu", ["RTX4090", "L40S"])
def test_table4_baselines_run_as_static_batches(gpu):
    lengths = [60 + 37 * i for i in range(10)]
    max_len = max(lengths) + GEN
    fast = DiffusionEmulation(gpu, logit_decomposition=False, pad_to_longest=True)
    cache = DiffusionEmulation(gpu, logit_decomposition=False, pad_to_longest=True, method="dllm_cache")
    sparse = DiffusionEmulation(gpu, logit_decomposition=False, pad_to_longest=True, method="sparse_dllm")
    fast_config, _ = static_baseline_config(fast, max_len, block_length=BLOCK)
    cache_config, cache_plan = static_baseline_config(cache, max_len, block_length=BLOCK)
    sparse_config, sparse_plan = static_baseline_config(sparse, max_len, block_length=BLOCK, retention_ratio=0.5)
    # dLLM-Cache keeps K, V, attention and MLP outputs: twice the KV per token, a smaller batch;
    # Sparse-dLLM keeps half the context: at least Fast-dLLM's batch.
    assert cache_plan.kv_bytes_per_token == 2 * fast.perf_model().kv_bytes_per_token
    assert cache_config.static_batch_size < fast_config.static_batch_size <= sparse_config.static_batch_size
    fast_clock, _ = _run(fast, fast_config, lengths)
    _, cache_engine = _run(cache, cache_config, lengths)
    _, sparse_engine = _run(sparse, sparse_config, lengths, retention_ratio=0.5)
    blocks = GEN // BLOCK
    assert sparse_engine.runner.stats.refresh_entries == 2 * blocks * len(lengths)  # two full forwards a block
    assert cache_engine.runner.stats.refresh_entries == len(lengths)  # one full forward, then its intervals
    assert sparse_engine.runner.stats.peak_logit_rows >= max_len  # every position's logits (no decomposition)
    one, plan = static_baseline_config(sparse, max_len, block_length=BLOCK, retention_ratio=0.5, batch_size=1)
    assert one.static_batch_size == plan.static_batch_size == 1 and plan.kv_pool_bytes < sparse_plan.kv_pool_bytes
    with pytest.raises(ValueError, match="does not fit"):
        static_baseline_config(sparse, max_len, block_length=BLOCK, retention_ratio=0.5, batch_size=10_000)
