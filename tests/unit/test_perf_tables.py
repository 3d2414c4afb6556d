"""splitserve.perf.tables: measured kernel-class tables, interpolated, as a PerfModel's step times."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.perf.model import PerfModel
from splitserve.perf.presets import preset
from splitserve.perf.tables import StepTables, monotone_grid

TOKENS = (1.0, 16.0, 256.0, 4096.0)
HIST = (0.0, 64.0, 1024.0, 8192.0)
BATCH = (1.0, 8.0, 64.0)
CTX = (1.0, 512.0, 8192.0)


def tables(**over) -> StepTables:
    raw = dict(
        tokens=TOKENS, context_linear=(5e-3, 6e-3, 9e-3, 0.1), generation_linear=(5e-3, 5.5e-3, 9e-3, 0.1),
        logits_rows=(1.0, 64.0, 1024.0), logits=(3e-4, 3.5e-4, 2e-3),
        chunk_tokens=TOKENS, chunk_history=HIST,
        prefill_attention=[[1e-4 * (1 + t / 64) * (1 + h / 1024) for h in HIST] for t in TOKENS],
        decode_batch=BATCH, decode_context=CTX,
        decode_attention=[[2e-5 * b * (1 + c / 256) for c in CTX] for b in BATCH],
        overhead_s=1e-4, source={"backend": "test"})
    raw.update(over)
    made, _ = StepTables.from_raw(**raw)
    return made


T = tables()
F = dataclasses.replace(T, overhead_s=2e-4, per_seq_overhead_s=3e-5, kernel_scale=1.25)  # a framework's cost on top


def test_grid_points_are_returned_exactly_and_a_step_is_the_sum_of_its_kernel_classes():
    assert T.linear_s(256, True) == 9e-3 and T.linear_s(256, False) == 9e-3 and T.linear_s(16, False) == 5.5e-3
    assert T.prefill_attention_s(256, 1024) == pytest.approx(1e-4 * 5 * 2)
    assert T.decode_attention_s(8, 512) == pytest.approx(2e-5 * 8 * 3)
    want = 1e-4 + T.linear_s(256 + 8, True) + T.logits_s(1 + 8) + T.prefill_attention_s(256, 1024) \
        + T.decode_attention_s(8, 512)
    assert T.step_s(((1024, 256),), 8, 512) == pytest.approx(want, rel=1e-12)
    # Two chunks: both attentions, one linear pass over all tokens, a logits row each.
    two = T.step_s(((0, 16), (64, 16)), 0, 0)
    assert two == pytest.approx(1e-4 + T.linear_s(32, True) + T.logits_s(2) + T.prefill_attention_s(16, 0)
                                + T.prefill_attention_s(16, 64), rel=1e-12)
    assert T.step_s((), 0, 0) == 0.0 and T.step_s(((5, 0),), 0, 0) == 0.0


def test_interpolation_is_linear_between_points_and_extends_the_last_slope():
    assert T.linear_s(136, True) == pytest.approx((6e-3 + 9e-3) / 2)
    slope = (0.1 - 9e-3) / (4096 - 256)
    assert T.linear_s(8192, True) == pytest.approx(0.1 + slope * 4096)
    assert T.linear_s(0.5, True) == 5e-3  # below the first point: the first point's value


def test_running_maxima_make_every_table_non_decreasing_and_report_the_fix():
    raw = {k: v for k, v in T.to_dict().items() if k not in ("format", "source", "overhead_s")}
    raw["context_linear"] = (5e-3, 4e-3, 9e-3, 0.1)
    made, fixes = StepTables.from_raw(**raw)
    assert made.context_linear == (5e-3, 5e-3, 9e-3, 0.1) and fixes["context_linear"] == pytest.approx(0.2)
    assert monotone_grid([[3, 1], [2, 5]]) == ((3, 3), (3, 5))


@settings(max_examples=300, deadline=None)
@given(h=st.floats(0, 20000), n=st.floats(1, 10000), dn=st.floats(0, 3000), dh=st.floats(0, 3000),
       b=st.integers(0, 200), db=st.integers(0, 50), c=st.floats(1, 20000), dc=st.floats(0, 5000))
def test_more_work_never_takes_less_time(h, n, dn, dh, b, db, c, dc):
    base = T.step_s(((h, n),), b, c)
    assert T.step_s(((h, n + dn),), b, c) >= base - 1e-12
    assert T.step_s(((h + dh, n),), b, c) >= base - 1e-12
    assert T.step_s(((h, n),), b + db, c) >= base - 1e-12
    assert T.step_s(((h, n),), b, c + dc) >= base - 1e-12


@pytest.mark.parametrize("which", ["kernels", "with a framework cost"])
@settings(max_examples=150, deadline=None)
@given(h=st.integers(0, 20000), n=st.integers(0, 10000), b=st.integers(0, 300), c=st.floats(1, 20000))
def test_the_aggregate_and_vector_forms_equal_one_chunk(which, h, n, b, c):
    tables = T if which == "kernels" else F
    one = tables.step_s(((h, n),), b, c)
    pairs = n * (h + n / 2)
    assert tables.aggregate_step_s(n, pairs, b, b * c) == pytest.approx(one, rel=1e-9, abs=1e-15)
    vec = tables.step_array([n, n], [pairs, pairs], [b, b], [b * c, b * c])
    assert vec[0] == pytest.approx(one, rel=1e-9, abs=1e-15)


def test_decode_runs_equal_their_steps():
    run = T.decode_run(8, 8 * 300, 5)
    assert np.allclose(run, [T.step_s((), 8, 300 + i) for i in range(5)], rtol=1e-12)


def test_a_perf_model_with_tables_times_every_step_from_them_and_round_trips():
    base = preset("H100", "Llama-3-8B")
    model = dataclasses.replace(base, tables=T, label="measured")
    assert model.backend == "test" and base.backend == "datasheet"
    assert model.prefill_time(64, 256) == T.step_s(((64, 256),), 0, 0)
    assert model.decode_time(8, 512) == T.step_s((), 8, 512)
    assert model.mixed_step_time(256, 64, 8, 512) == T.step_s(((64, 256),), 8, 512)
    assert model.step_seconds(256, 64, 8, 8 * 512, 256 * (64 + 128)) == pytest.approx(model.mixed_step_time(256, 64, 8, 512))
    assert np.allclose(model.decode_run_times(8, 8 * 300, 3), T.decode_run(8, 8 * 300, 3))
    assert model.step_times([256], [64], [8], [8 * 512])[0] == pytest.approx(model.mixed_step_time(256, 64, 8, 512))
    assert model.kv_transfer_time(1000) == base.kv_transfer_time(1000)  # transfers stay the coefficients'
    again = PerfModel.from_json(model.to_json())
    assert again == model and again.tables.digest == T.digest and hash(again) == hash(model)
    assert model.describe()["tables"] == {"source": {"backend": "test"}, "digest": T.digest}
    assert "test" in model.timing_note and "datasheet" in base.timing_note
    # L_m from the curves: a one-token prefill over the GEMMs' per-token seconds at large sizes.
    assert model.prefill_boundary(0) == pytest.approx(T.step_s(((0, 1),), 0, 0) / ((0.1 - 9e-3) / (4096 - 256)))
    assert model.max_prefill_tokens(0.02) == max(n for n in range(1, 5000) if model.prefill_time(0, n) <= 0.02)


@pytest.mark.parametrize("field,value,message", [
    ("tokens", (1.0, 1.0, 2.0, 3.0), "strictly increasing"),
    ("context_linear", (1.0, 2.0), "one value per tables.tokens"),
    ("decode_attention", ((1.0, 2.0, 3.0),), "decode_batch x decode_context"),
    ("overhead_s", -1.0, "overhead_s"),
    ("per_seq_overhead_s", -1e-6, "per_seq_overhead_s"),
    ("kernel_scale", 0.9, "kernel_scale"),
])
def test_bad_tables_are_refused_naming_the_field(field, value, message):
    data = dict(T.to_dict())
    data[field] = value
    with pytest.raises(ValueError, match=message):
        StepTables.from_dict(data)
    with pytest.raises(ValueError, match="format"):
        StepTables.from_dict({**T.to_dict(), "format": 99})


# ---- the framework's own cost on top of the kernels (splitserve.perf.framework) ----------------


def test_a_framework_cost_is_per_step_per_sequence_and_a_scale_on_the_kernels():
    kernels = T.step_s(((1024, 256),), 8, 512) - T.overhead_s
    assert F.step_s(((1024, 256),), 8, 512) == pytest.approx(2e-4 + 3e-5 * 9 + 1.25 * kernels, rel=1e-12)
    decode = T.step_s((), 8, 300) - T.overhead_s
    assert F.step_s((), 8, 300) == pytest.approx(2e-4 + 3e-5 * 8 + 1.25 * decode, rel=1e-12)
    assert F.step_s((), 0, 0) == 0.0  # an empty step costs nothing, framework or not
    assert np.allclose(F.decode_run(8, 8 * 300, 5), [F.step_s((), 8, 300 + i) for i in range(5)], rtol=1e-12)
    assert F.linear_slope_s() == pytest.approx(1.25 * T.linear_slope_s())


def test_a_framework_cost_round_trips_and_kernel_tables_keep_their_digest():
    again = StepTables.from_dict(F.to_dict())
    assert again == F and (again.per_seq_overhead_s, again.kernel_scale) == (3e-5, 1.25)
    assert "kernel_scale" not in T.to_dict() and F.digest != T.digest  # cached kernel tables stay valid


def test_with_framework_overhead_adds_the_fitted_cost_and_says_so():
    from splitserve.perf.framework import FRAMEWORK_OVERHEADS, FrameworkOverhead, with_framework_overhead

    base = dataclasses.replace(preset("H100", "Llama-3-8B"), tables=T, label="measured")
    vllm = with_framework_overhead(base, "vllm")
    fo = FRAMEWORK_OVERHEADS["vllm"]
    assert vllm.label == "measured+vllm-overhead" and vllm is with_framework_overhead(base, "vllm")
    assert vllm.tables.kernel_scale == fo.kernel_scale and vllm.tables.per_seq_overhead_s == fo.per_seq_s
    assert vllm.tables.overhead_s == pytest.approx(T.overhead_s + fo.overhead_s)
    assert vllm.tables.source["framework_overhead"]["vllm"]["fitted_to"] == fo.source
    assert vllm.decode_time(64, 1024) > base.decode_time(64, 1024)
    other = with_framework_overhead(base, "trtllm")  # no end-to-end fit: the kernels, and the label says so
    assert other.tables == T and "kernels-only(trtllm" in other.label
    datasheet = preset("H100", "Llama-3-8B")
    assert with_framework_overhead(datasheet, "vllm") is datasheet  # keeps its own overheads
    with pytest.raises(ValueError, match="kernel_scale"):
        FrameworkOverhead(0.0, 0.0, 0.5, "bad")
    with pytest.raises(ValueError, match="per_seq_s"):
        FrameworkOverhead(0.0, -1.0, 1.0, "bad")


def test_added_seconds_is_each_kernel_class_share_of_a_request():
    """DynaServe's clock (Alg. 1) charges a request its GEMMs at the compute-bound slope, its
    prefill attention, and per decode token the 16-64 secant of decode attention at the mean
    context, all scaled like the steps, plus the per-sequence cost."""
    slope = F.linear_slope_s()
    assert slope == pytest.approx(1.25 * (0.1 - 9e-3) / (4096 - 256))
    prefill_only = F.added_seconds(256, 1024, 0)
    assert prefill_only == pytest.approx(slope * 256 + 3e-5 + 1.25 * F.prefill_attention_s(256, 1024))
    mean_ctx = 1024 + 256 + 1 + (10 - 1) / 2
    per_decode = (F.decode_attention_s(64, mean_ctx) - F.decode_attention_s(16, mean_ctx)) / 48
    assert per_decode == pytest.approx(2e-5 * (1 + mean_ctx / 256))  # the test tables: linear in batch
    assert F.added_seconds(256, 1024, 10) == pytest.approx(prefill_only + 10 * (slope + 3e-5 + 1.25 * per_decode))
    assert F.added_seconds(0, 0, 0) == 0.0
    # Decodes at longer context read more KV: more work, unlike the compute line's near-constant decode.
    assert F.added_seconds(0, 8000, 10) > 2 * F.added_seconds(0, 100, 10)


def test_attention_per_pair_is_the_secant_over_history():
    want = 1.25 * (F.prefill_attention_s(512, 8192) - F.prefill_attention_s(512, 0)) / (512 * 8192)
    assert F.attention_s_per_pair() == pytest.approx(want) and want > 0
    model = dataclasses.replace(preset("A100", "Llama-3-8B"), tables=F)
    assert model.attention_s_per_pair == pytest.approx(want)
    assert model.work_seconds(256, 1024, 10) == F.added_seconds(256, 1024, 10)
    datasheet = preset("A100", "Llama-3-8B")
    assert datasheet.attention_s_per_pair == datasheet.prefill.c_attn
