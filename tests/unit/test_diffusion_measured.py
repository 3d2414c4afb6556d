"""The measured diffusion step times (splitserve/core/diffusion_perf.py, `MeasuredDiffusionPerfModel`):
denoising steps timed kernel by kernel from aiconfigurator's tables of an autoregressive twin of
LLaDA-8B, behind the same interface as the datasheet roofline."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("aiconfigurator_core")

from splitserve.core.diffusion import (DiffusionBatch, DiffusionParams, DiffusionSequence,  # noqa: E402
                                       DiffusionWork, Phase)
from splitserve.core.diffusion_perf import (ONE_QUERY_TILE, DiffusionPerfModel, MeasuredDiffusionPerfModel,  # noqa: E402
                                       diffusion_perf_model)

PARAMS = DiffusionParams(gen_length=256, block_length=32, steps=256)  # dLLM-Serve Table 3
COVERED = ("L40S", "A100", "H100")


@pytest.fixture(scope="module", params=COVERED)
def measured(request) -> MeasuredDiffusionPerfModel:
    model = diffusion_perf_model(request.param, "LLaDA-8B", backend="aiconfigurator")
    assert isinstance(model, MeasuredDiffusionPerfModel)
    return model


def _work(prompt_len: int, phase: Phase, params: DiffusionParams = PARAMS, key: str = "r",
          step_in_block: int | None = None) -> DiffusionWork:
    if step_in_block is None:
        step_in_block = 0 if phase is Phase.REFRESH else 1
    seq = DiffusionSequence(key, prompt_len, params, step_in_block=step_in_block)
    return DiffusionWork(seq, phase, seq.query_tokens("dual"), admitted=False)


def _batch(*works: DiffusionWork) -> DiffusionBatch:
    return DiffusionBatch(list(works))


def _index(grid, value) -> int:
    return list(grid).index(float(value))


# ---- which backend times the steps -------------------------------------------------------------
def test_backends_say_what_timed_the_steps(caplog):
    datasheet = diffusion_perf_model("L40S", backend="datasheet")
    assert type(datasheet) is DiffusionPerfModel and datasheet.backend == "datasheet"
    assert "datasheet roofline (not measured)" in datasheet.describe()
    measured = diffusion_perf_model("L40S", backend="auto")
    assert measured.backend == "aiconfigurator" and measured.tables.source["system"] == "l40s"
    assert "measured kernel tables" in measured.describe() and "autoregressive twin" in measured.describe()
    with caplog.at_level(logging.WARNING, logger="splitserve.core.diffusion_perf"):
        fallback = diffusion_perf_model("RTX4090", backend="auto")
    assert fallback.backend == "datasheet" and "RTX-4090" in fallback.note
    assert "WARNING" in fallback.describe() and "not measured" in fallback.describe()
    with pytest.raises(ValueError, match="RTX-4090"):
        diffusion_perf_model("RTX4090", backend="aiconfigurator")
    with pytest.raises(ValueError, match="backend"):
        diffusion_perf_model("L40S", backend="roofline-ish")
    with pytest.raises(ValueError, match="reuse_attention"):
        diffusion_perf_model("L40S", backend="aiconfigurator", reuse_attention="guess")


def test_the_memory_model_is_the_roofline_s(measured):
    roofline = DiffusionPerfModel.preset(measured.gpu, measured.model)
    assert measured.weight_bytes == roofline.weight_bytes and measured.kv_bytes_per_token == roofline.kv_bytes_per_token
    assert measured.largest_static_batch(1280).to_dict() == roofline.largest_static_batch(1280).to_dict()
    assert measured.logit_aware_plan(16384, 2048).to_dict() == roofline.logit_aware_plan(16384, 2048).to_dict()


# ---- the tables at their grid points -----------------------------------------------------------
def test_a_refresh_is_the_tables_at_grid_points(measured):
    """One Refresh of 512 tokens (prompt 256 + 256): the linear kernels of 512 tokens, bidirectional
    attention of 512 x 512 pairs = the causal chunk of 512 on 256 cached, the block's 32 logit rows."""
    t = measured.tables
    cost = measured.step_cost(_batch(_work(256, Phase.REFRESH)))
    linear = t.context_linear[_index(t.tokens, 512)]
    attention = t.prefill_attention[_index(t.chunk_tokens, 512)][_index(t.chunk_history, 256)]
    logits = t.logits[_index(t.logits_rows, 32)]
    assert dict(cost.kernels) == pytest.approx({"linear": linear, "attention": attention, "logits": logits}, rel=1e-12)
    assert cost.measured_s == pytest.approx(linear + attention + logits, rel=1e-12)
    assert cost.seconds == pytest.approx(cost.overhead_s + linear + attention + logits, rel=1e-12)
    assert cost.attention_pairs == 512 * 512  # 2 x the causal chunk's 512 x 256 + 512^2 / 2


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_reuse_steps_of_equal_contexts_are_the_decode_table(measured, batch):
    """B Reuse blocks of 32 queries over 992 cached + 32 own keys: the measured decode attention of
    B sequences of 1,024 (one query tile each, the same kernel), linear and logits of 32 B rows."""
    t = measured.tables
    cost = measured.step_cost(_batch(*[_work(768, Phase.REUSE, key=str(i)) for i in range(batch)]))
    kernels = dict(cost.kernels)
    assert kernels["attention"] == pytest.approx(
        t.decode_attention[_index(t.decode_batch, batch)][_index(t.decode_context, 1024)], rel=1e-12)
    assert kernels["linear"] == pytest.approx(t.context_linear[_index(t.tokens, 32 * batch)], rel=1e-12)
    assert kernels["logits"] == pytest.approx(t.logits[_index(t.logits_rows, 32 * batch)], rel=1e-12)


def test_reuse_attention_on_the_prefill_table_is_the_per_request_chunk():
    measured = diffusion_perf_model("L40S", backend="aiconfigurator", reuse_attention="prefill")
    t = measured.tables
    cost = measured.step_cost(_batch(*[_work(768, Phase.REUSE, key=str(i)) for i in range(3)]))
    # 32 queries over 992 cached keys and their own: the causal chunk of 32 on 992 + 16 cached.
    assert dict(cost.kernels)["attention"] == pytest.approx(3 * t.prefill_attention_s(32, 992 + 16), rel=1e-12)


def test_bidirectional_attention_is_about_twice_the_causal(measured):
    """The mapping prefill_attention(n, n/2) has the n^2 pairs of 2 x causal(n): for long sequences
    it agrees with 2 x the measured causal rows; for short ones it counts one launch floor, not two."""
    t = measured.tables
    for n in (4096, 8192, 16384):
        assert t.prefill_attention_s(n, n / 2) == pytest.approx(2 * t.prefill_attention_s(n, 0), rel=0.125)
    for n in (256, 640, 1280):
        assert t.prefill_attention_s(n, 0) < t.prefill_attention_s(n, n / 2) <= 2 * t.prefill_attention_s(n, 0)


def test_logits_past_the_grid_and_in_chunks(measured):
    t = measured.tables
    top = t.logits_rows[-1]
    assert top == 2048
    assert measured.logits_s(4096) == pytest.approx(2 * t.logits[-1])  # one GEMM: the compute-bound per-row rate
    assert measured.logits_s(3000, max_num_logits=2048) == pytest.approx(t.logits[-1] + t.logits_s(952))
    assert measured.logits_s(4096, max_num_logits=1024) == pytest.approx(4 * t.logits[_index(t.logits_rows, 1024)])
    assert measured.logits_s(0) == 0.0


# ---- the properties of a step time -------------------------------------------------------------
@pytest.mark.parametrize("prompt", [64, 384, 1024, 3000])
def test_refresh_costs_at_least_a_reuse(measured, prompt):
    refresh = measured.step_cost(_batch(_work(prompt, Phase.REFRESH)))
    reuse = measured.step_cost(_batch(_work(prompt, Phase.REUSE)))
    assert refresh.seconds >= reuse.seconds
    many_refresh = measured.step_cost(_batch(*[_work(prompt, Phase.REFRESH, key=str(i)) for i in range(8)]))
    many_reuse = measured.step_cost(_batch(*[_work(prompt, Phase.REUSE, key=str(i)) for i in range(8)]))
    assert many_refresh.seconds >= many_reuse.seconds


def test_the_empty_step_takes_no_time(measured):
    assert measured.step_cost(DiffusionBatch()).seconds == 0.0


_ENTRY = st.tuples(st.integers(1, 3500), st.sampled_from([Phase.REFRESH, Phase.REUSE]),
                   st.sampled_from([1.0, 0.5, 0.25]), st.integers(0, 255))


def _works(entries) -> list[DiffusionWork]:
    out = []
    for i, (prompt, phase, ratio, step) in enumerate(entries):
        params = DiffusionParams(gen_length=256, block_length=32, steps=256, retention_ratio=ratio)
        seq = DiffusionSequence(str(i), prompt, params, block=step // 32,
                                step_in_block=0 if phase is Phase.REFRESH else max(1, step % 32))
        out.append(DiffusionWork(seq, phase, seq.query_tokens("dual"), admitted=False))
    return out


@settings(max_examples=60, deadline=None)
@given(entries=st.lists(_ENTRY, min_size=1, max_size=24), extra=_ENTRY, grow=st.integers(1, 600),
       gpu=st.sampled_from(COVERED), method=st.sampled_from(["dual", "sparse_dllm", "dllm_cache"]),
       reuse=st.sampled_from(["decode", "prefill"]), full=st.booleans(), padded=st.booleans(),
       chunk=st.sampled_from([None, 2048]))
def test_step_time_is_monotone_in_the_work(entries, extra, grow, gpu, method, reuse, full, padded, chunk):
    """More requests, longer prompts, a Reuse turned Refresh: never a shorter step (every kernel
    table is non-decreasing and the Reuse group's reading of the decode table is monotone)."""
    perf = diffusion_perf_model(gpu, backend="aiconfigurator", reuse_attention=reuse)
    options = dict(method=method, full_sequence_logits=full, pad_to_longest=padded, max_num_logits=chunk)
    base = _works(entries)
    t0 = perf.step_cost(DiffusionBatch(base), **options).seconds
    more = perf.step_cost(DiffusionBatch(base + _works([extra])[:1]), **options).seconds
    assert more >= t0 * (1 - 1e-12)
    longer = _works([(p + grow, ph, r, s) for p, ph, r, s in entries])
    assert perf.step_cost(DiffusionBatch(longer), **options).seconds >= t0 * (1 - 1e-12)
    if method == "dual":
        refreshed = _works([(p, Phase.REFRESH, r, s) for p, _, r, s in entries])
        assert perf.step_cost(DiffusionBatch(refreshed), **options).seconds >= t0 * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.integers(1, 5000), min_size=1, max_size=300), extra=st.integers(1, 5000),
       grow=st.integers(1, 2000), which=st.integers(0, 299), gpu=st.sampled_from(COVERED))
def test_the_reuse_group_reading_is_monotone_and_exact_for_equal_contexts(keys, extra, grow, which, gpu):
    perf = diffusion_perf_model(gpu, backend="aiconfigurator")
    t = perf.tables
    base = perf.reuse_group_s(keys)
    assert perf.reuse_group_s(keys + [extra]) >= base * (1 - 1e-12)
    longer = list(keys)
    longer[which % len(keys)] += grow
    assert perf.reuse_group_s(longer) >= base * (1 - 1e-12)
    # Exact within the measured grid (LLaDA's 4,096-token context): beyond its last context each
    # batch row extends along its own last slope, and rows may then cross by a few ppm.
    equal = [min(keys[0], t.decode_context[-1])] * len(keys)
    assert perf.reuse_group_s(equal) == pytest.approx(t.decode_attention_s(len(keys), equal[0]), rel=1e-9)


def test_a_reuse_block_fits_one_query_tile():
    assert PARAMS.block_length <= ONE_QUERY_TILE  # the decode-table mapping applies to Table 3's blocks
    assert int(256 * 0.25) <= ONE_QUERY_TILE  # and to dLLM-Cache's transferred positions


def test_measured_and_datasheet_agree_on_a_large_refresh_within_a_factor_of_two(measured):
    """A compute-bound step (16 Refreshes of 1,024 tokens): the roofline's 50% of peak and the
    measured GEMMs are the same order; what differs is the memory-bound and attention side."""
    roofline = DiffusionPerfModel.preset(measured.gpu, measured.model)
    batch = _batch(*[_work(768, Phase.REFRESH, key=str(i)) for i in range(16)])
    ratio = measured.step_time(batch) / roofline.step_time(batch)
    assert 0.5 < ratio < 2.0
