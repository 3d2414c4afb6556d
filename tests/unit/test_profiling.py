"""workers/profiling.py on an emulated engine in-process: shapes, skips, KV given back, grid validation."""

from __future__ import annotations

import pytest

from splitserve.perf_model import ProfileSample, fit_perf_model
from splitserve.profile_cli import base_model_for, parse_ints
from workers.engine.config import EngineConfig
from workers.engine.emulated import Emulation, StepPacer, build_emulated_engine
from workers.profiling import ProfileGrid, decode_shapes, prefill_shapes, profile_engine


class VirtualTime:
    """The pacer's clock and sleep: an emulated pass takes exactly the model's time, instantly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def engine():
    clock = VirtualTime()
    eng = build_emulated_engine(EngineConfig(model="", kv_cache_memory_bytes=20 << 30, max_num_seqs=64),
                                Emulation("H100", "llama-3-8b"))
    eng.runner.pacer = StepPacer(clock=clock, sleep=clock.sleep, cpu_clock=clock)
    return eng, clock


def test_grid_shapes_and_validation():
    grid = ProfileGrid(prefill_lens=(16, 64), history_lens=(0, 100), decode_batch_sizes=(1, 8),
                       decode_context_lens=(32,), repeats=2)
    assert prefill_shapes(grid) == [(0, 16), (0, 64), (100, 16), (100, 64)]
    assert decode_shapes(grid) == [(1, 32), (8, 32)]
    for bad in ({"repeats": 0}, {"repeats": 51}, {"prefill_lens": (0,)}, {"history_lens": ()},
                {"decode_context_lens": ()}, {"prefill_lens": (), "decode_batch_sizes": ()},
                {"prefill_lens": tuple(range(1, 300)), "history_lens": (0, 1)}):
        with pytest.raises(ValueError):
            ProfileGrid(**bad)
    assert parse_ints("1,2, 3", "--x") == (1, 2, 3) and parse_ints("none", "--x") == ()
    with pytest.raises(ValueError, match="--x"):
        parse_ints("1,a", "--x")
    with pytest.raises(ValueError, match="--x"):
        parse_ints("0", "--x")


def test_profile_measures_the_models_time_and_gives_every_block_back(engine):
    eng, clock = engine
    perf = eng.runner.perf
    free = eng.load().free_blocks
    grid = ProfileGrid(prefill_lens=(64, 512, 2048), history_lens=(0, 1024), decode_batch_sizes=(1, 32, 64),
                       decode_context_lens=(128, 4000, 9000), repeats=2)
    result = profile_engine(eng, grid, clock)
    assert eng.load().free_blocks == free
    assert not eng.scheduler.sequences and not eng.has_unfinished()
    assert result.device.startswith("emulated:") and result.engine_kind == "emulated"
    # 9000 tokens exceed the emulated max_model_len (8192); 64 x 4000 tokens exceed the 20 GiB cache.
    skipped = {(s.batch, s.ctx): s.skipped for s in result.skipped}
    assert set(skipped) == {(1, 9000), (32, 9000), (64, 9000), (64, 4000)}
    assert "max_model_len" in skipped[(1, 9000)] and "free KV blocks" in skipped[(64, 4000)]
    for s in result.samples:
        want = perf.prefill_time(s.l_hist, s.l_incr) if s.kind == "prefill" else perf.decode_time(s.batch, s.ctx)
        assert s.seconds == pytest.approx(want, rel=1e-9) and len(s.runs) == 2
    samples = [ProfileSample(s.kind, s.l_hist, s.l_incr, s.batch or 1, s.ctx, seconds=s.seconds)
               for s in result.samples]
    fitted = fit_perf_model(samples, base=perf)
    assert fitted.fit.prefill.max_rel < 0.02 and fitted.fit.decode.max_rel < 0.02


def test_base_model_from_an_emulated_device_or_a_preset():
    assert base_model_for("", "emulated:H100-SXM5-80GBx1/Llama-3-8B").label.startswith("preset:H100")
    assert base_model_for("A100/llama-3-8b", "cpu").label.startswith("preset:A100")
    assert base_model_for("", "cpu") is None
    with pytest.raises(ValueError, match="--base"):
        base_model_for("nonsense", "cpu")
