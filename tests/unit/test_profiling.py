"""workers/profiling.py on an emulated engine in-process: shapes, skips, KV given back, grid validation."""

from __future__ import annotations

import pytest

from splitserve.perf.model import ProfileSample, fit_perf_model
from splitserve.cli.profile import base_model_for, parse_ints
from workers.engine.config import EngineConfig
from workers.engine.emulated import Emulation, StepPacer, build_emulated_engine
from workers.profiling import ProfileGrid, decode_shapes, mixed_shapes, prefill_shapes, profile_engine


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
                                # The roofline: a max of two lines, which the fit below recovers exactly.
                                Emulation("H100", "llama-3-8b", perf_backend="datasheet"))
    eng.runner.pacer = StepPacer(clock=clock, sleep=clock.sleep, cpu_clock=clock)
    return eng, clock


def test_grid_shapes_and_validation():
    grid = ProfileGrid(prefill_lens=(16, 64), history_lens=(0, 100), decode_batch_sizes=(1, 8),
                       decode_context_lens=(32,), repeats=2)
    assert prefill_shapes(grid) == [(0, 16), (0, 64), (100, 16), (100, 64)]
    assert decode_shapes(grid) == [(1, 32), (8, 32)]
    for bad in ({"repeats": 0}, {"repeats": 51}, {"prefill_lens": (0,)}, {"history_lens": ()},
                {"decode_context_lens": ()},
                {"prefill_lens": (), "decode_batch_sizes": (), "mixed_prefill_lens": ()},
                {"mixed_decode_batch_sizes": ()}, {"mixed_decode_context_lens": ()}, {"mixed_history_lens": ()},
                {"mixed_prefill_lens": (0,)},
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
                       decode_context_lens=(128, 4000, 9000), mixed_prefill_lens=(256, 1024),
                       mixed_history_lens=(0, 2000), mixed_decode_batch_sizes=(8, 64),
                       mixed_decode_context_lens=(512, 4000), repeats=2)
    assert len(mixed_shapes(grid)) == 16 and mixed_shapes(grid)[0] == (0, 256, 8, 512)
    result = profile_engine(eng, grid, clock)
    assert eng.load().free_blocks == free
    assert not eng.scheduler.sequences and not eng.has_unfinished()
    assert result.device.startswith("emulated:") and result.engine_kind == "emulated"
    # 9000 tokens exceed the emulated max_model_len (8192); 64 x 4000 tokens exceed the 20 GiB cache;
    # 64 decodes beside a prefill chunk are 65 sequences, over max_num_seqs (64).
    skipped = {(s.kind, s.batch, s.ctx): s.skipped for s in result.skipped}
    assert set(skipped) == {("decode", 1, 9000), ("decode", 32, 9000), ("decode", 64, 9000), ("decode", 64, 4000),
                            ("mixed", 64, 512), ("mixed", 64, 4000)}
    assert "max_model_len" in skipped[("decode", 1, 9000)] and "free KV blocks" in skipped[("decode", 64, 4000)]
    assert "max_num_seqs" in skipped[("mixed", 64, 512)]
    assert sum(s.kind == "mixed" for s in result.samples) == 8
    for s in result.samples:
        want = {"prefill": lambda: perf.prefill_time(s.l_hist, s.l_incr),
                "decode": lambda: perf.decode_time(s.batch, s.ctx),
                "mixed": lambda: perf.mixed_step_time(s.l_incr, s.l_hist, s.batch, s.ctx)}[s.kind]()
        assert s.seconds == pytest.approx(want, rel=1e-9) and len(s.runs) == 2
    samples = [ProfileSample(s.kind, s.l_hist, s.l_incr, s.batch or 1, s.ctx, seconds=s.seconds)
               for s in result.samples]
    fitted = fit_perf_model(samples, base=perf)
    assert fitted.fit.prefill.max_rel < 0.02 and fitted.fit.decode.max_rel < 0.02
    # The emulated steps are the max form itself, so its mixed steps are reproduced too (the
    # decode samples sit in one regime: the mixed ones choose how its lines compose).
    assert fitted.fit.mixed.n == 8 and fitted.fit.mixed.max_rel < 0.02


def test_base_model_from_an_emulated_device_or_a_preset():
    assert base_model_for("", "emulated:H100-SXM5-80GBx1/Llama-3-8B").label.startswith("preset:H100")
    assert base_model_for("A100/llama-3-8b", "cpu").label.startswith("preset:A100")
    assert base_model_for("", "cpu") is None
    with pytest.raises(ValueError, match="--base"):
        base_model_for("nonsense", "cpu")


def test_mixed_grid_over_the_wire_and_back_to_samples():
    from splitserve.perf.presets import preset
    from splitserve.cli.profile import _predict, samples_from_response
    from splitserve.proto import worker_pb2

    request = worker_pb2.ProfileRequest(prefill_lens=[16], mixed_prefill_lens=[32, 64], mixed_history_lens=[0],
                                        mixed_decode_batch_sizes=[4], mixed_decode_context_lens=[100, 200])
    grid = ProfileGrid.from_request(request)
    assert mixed_shapes(grid) == [(0, 32, 4, 100), (0, 32, 4, 200), (0, 64, 4, 100), (0, 64, 4, 200)]
    assert grid.decode_batch_sizes == ProfileGrid().decode_batch_sizes  # empty: the defaults, as before
    default = ProfileGrid.from_request(worker_pb2.ProfileRequest())
    assert mixed_shapes(default) == mixed_shapes(ProfileGrid()) and len(mixed_shapes(default)) == 36
    response = worker_pb2.ProfileResponse(samples=[
        worker_pb2.ProfileSample(kind="prefill", l_hist=0, l_incr=16, seconds=0.01),
        worker_pb2.ProfileSample(kind="mixed", l_hist=8, l_incr=32, batch=4, ctx=100, seconds=0.02)])
    prefill, mixed = samples_from_response(response)
    assert (prefill.kind, prefill.batch) == ("prefill", 1)
    assert (mixed.kind, mixed.l_hist, mixed.l_incr, mixed.batch, mixed.ctx) == ("mixed", 8, 32, 4, 100)
    model = preset("H100", "llama-3-8b")
    assert _predict(model, mixed) == model.mixed_step_time(32, 8, 4, 100)
