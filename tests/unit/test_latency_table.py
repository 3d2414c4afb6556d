"""DynaServe's profile table (`LatencyTable`) and MaxPrefillAllowed, pure: no scheduler.

Seeded from a performance model it predicts that model's steps from above (the model is
convex along every axis, the table interpolates it linearly), so MaxPrefillAllowed never
promises more than the model allows; it stays monotone whatever it observes; it
converges from a wrong prior to the latencies it measures; its memory is fixed.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core import LatencyTable, StepShape
from splitserve.core.policies.latency_table import CONTEXT_GRID, DECODE_GRID, PREFILL_GRID
from splitserve.perf.model import PerfModel
from splitserve.perf.presets import preset

A100_14B = preset("A100", "Qwen2.5-14B")
H100_8B = preset("H100", "Llama-3-8B")


def scaled(model: PerfModel, factor: float) -> PerfModel:
    """`model` with every step coefficient times `factor` (a model `factor` times too slow)."""
    def scale(coeffs):
        return dataclasses.replace(coeffs, **{f.name: getattr(coeffs, f.name) * factor
                                              for f in dataclasses.fields(coeffs)})
    return dataclasses.replace(model, prefill=scale(model.prefill), decode=scale(model.decode),
                               label=f"{model.label} x{factor}")


def true_time(model: PerfModel, prefill: int, ctx: float, decodes: int) -> float:
    return model.step_time(((0, prefill),) if prefill else (), decodes, ctx)


# ---- the seeded table ----------------------------------------------------------------------


def test_the_grid_is_fixed_and_the_seeded_table_equals_the_model_at_its_vertices():
    assert len(LatencyTable()) == len(PREFILL_GRID) * len(DECODE_GRID) * len(CONTEXT_GRID) == 14 * 14 * 16
    table = LatencyTable(A100_14B)
    for p in (0, 16, 512, 2048, 65536):
        for d in (0, 1, 64, 256):
            for c in (0, 1024, 8192):
                assert table.predict(p, c, d) == pytest.approx(true_time(A100_14B, p, c, d), rel=1e-12)
    assert table.history_cost_s_per_pair == A100_14B.prefill.c_attn
    assert table.prior_label == A100_14B.label
    assert table.is_monotone()


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from([A100_14B, H100_8B]), target_ms=st.floats(5, 400),
       ctx=st.floats(1, 200_000), decodes=st.integers(1, 1024))
def test_a_seeded_table_never_allows_more_prefill_than_its_model(model, target_ms, ctx, decodes):
    table = LatencyTable(model)
    target = target_ms / 1000
    allowed = table.max_prefill(target, ctx, decodes, limit=1 << 16)
    exact = model.max_prefill_tokens(target, decode_batch=decodes, decode_ctx=ctx, limit=1 << 16)
    assert allowed <= exact + 1  # interpolating a convex model linearly overestimates it
    if allowed:
        # One exception: a step's fixed cost jumps from the decodes' intercept to the larger
        # of the prefill's and the decodes' at the first prefill token, and the table's first
        # segment (0 to 16 tokens) interpolates across that jump, so within it the table may
        # be low by at most the jump (found by this test: 6 us on a 153 ms target).
        p, d = model.prefill, model.decode
        jump = max(max(p.c0, d.c0) - d.c0, max(p.m0, d.m0) - d.m0) if allowed < PREFILL_GRID[1] else 0.0
        assert true_time(model, allowed, ctx, decodes) <= target * (1 + 1e-9) + jump


@pytest.mark.parametrize("model", [A100_14B, H100_8B], ids=["A100/Qwen2.5-14B", "H100/Llama-3-8B"])
def test_a_seeded_table_allows_nearly_what_its_model_does(model):
    # How conservative the seed is, over ITL targets of 30-200 ms: a few percent on average;
    # most where decodes of long contexts are memory-bound and a prefill would turn the step
    # compute-bound inside one cell (the steps the policy runs there then correct it).
    table = LatencyTable(model)
    rng = random.Random(0)
    ratios = []
    for _ in range(2000):
        target, ctx, d = rng.uniform(0.03, 0.2), rng.uniform(100, 32_000), rng.randint(1, 512)
        exact = model.max_prefill_tokens(target, decode_batch=d, decode_ctx=ctx)
        if exact >= 64:
            ratios.append(table.max_prefill(target, ctx, d) / exact)
    ratios.sort()
    assert len(ratios) > 300 and ratios[-1] <= 1.0
    assert sum(ratios) / len(ratios) > 0.92 and ratios[len(ratios) // 10] > 0.75  # measured 0.94 / 0.78 (A100), 0.95 / 0.84 (H100)
    # Where decodes have short contexts (the paper's Fig. 6: 128 and 1024 tokens), nearly exact.
    for d in (1, 8, 16, 29, 64, 128):
        for ctx in (128, 1024):
            exact = model.max_prefill_tokens(0.05, decode_batch=d, decode_ctx=ctx)
            assert exact - 16 <= table.max_prefill(0.05, ctx, d) <= exact + 1


@settings(max_examples=200, deadline=None)
@given(p=st.integers(0, 1 << 16), ctx=st.floats(0, 1 << 20), decodes=st.integers(0, 4096))
def test_a_seeded_table_predicts_its_model_from_above_and_closely(p, ctx, decodes):
    if decodes == 0 and p < PREFILL_GRID[1]:
        return  # between the empty step (0 s) and one block: never asked (no decodes: no target)
    predicted = LatencyTable(A100_14B).predict(p, ctx, decodes)
    exact = true_time(A100_14B, p, ctx, decodes)
    assert exact * (1 - 1e-3) <= predicted <= exact * 1.6  # (a prefill's intercept c0 exceeds a decode's by 10 us)


def test_max_prefill_answers_for_the_examples_of_the_paper():
    # Qwen2.5-14B on an A100 under a 100 ms ITL SLO: fewer tokens as the decode batch grows.
    table = LatencyTable(A100_14B)
    budgets = [table.max_prefill(0.1, 1000, d) for d in (1, 32, 64, 128, 256)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 500 > budgets[-1]
    assert table.max_prefill(0.1, 2000, 400) == 0  # the decodes alone take more than 100 ms
    assert true_time(A100_14B, 0, 2000, 400) > 0.1
    assert table.max_prefill(10.0, 1000, 8, limit=2048) == 2048  # the limit caps it


def test_a_step_on_history_costs_its_attention_pairs_more():
    table = LatencyTable(A100_14B)
    plain = table.predict_shape(StepShape(((0, 512),), 32, 32 * 1000))
    on_history = table.predict_shape(StepShape(((6000, 512),), 32, 32 * 1000))
    assert on_history - plain == pytest.approx(A100_14B.prefill.c_attn * 6000 * 512)
    # Where compute-bound (here), that is the model's own difference.
    exact = A100_14B.step_time(((6000, 512),), 32, 1000) - A100_14B.step_time(((0, 512),), 32, 1000)
    assert on_history - plain == pytest.approx(exact, rel=1e-6)


# ---- learning ------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_table_seeded_with_a_wrong_model_converges_to_what_it_measures(factor):
    truth, table = A100_14B, LatencyTable(scaled(A100_14B, factor))
    rng = random.Random(7)
    points = [(rng.choice([0, 64, 200, 333, 480, 700]), rng.uniform(300, 3000), rng.randint(1, 200))
              for _ in range(40)]
    before = max(abs(table.predict(*pt) / true_time(truth, *pt) - 1) for pt in points)
    assert before > 0.3
    for _ in range(200):
        for pt in rng.sample(points, len(points)):
            table.observe(*pt, true_time(truth, *pt))
    # Within the table's resolution: a cell's corners fit its observed points in least
    # squares (with the right model as prior too, the fit ends 2.4% / 0.4% off at worst / on average).
    after = [abs(table.predict(*pt) / true_time(truth, *pt) - 1) for pt in points]
    assert max(after) < 0.06 and sum(after) / len(after) < 0.012
    assert table.is_monotone()
    # MaxPrefillAllowed where the steps ran follows the measurements, not the prior.
    for d, ctx in ((32, 1000.0), (100, 2000.0)):
        exact = truth.max_prefill_tokens(0.09, decode_batch=d, decode_ctx=ctx)
        assert abs(table.max_prefill(0.09, ctx, d) - exact) <= 0.03 * exact


def test_one_point_observed_again_and_again_converges_geometrically():
    table = LatencyTable(A100_14B, learning_rate=0.25)
    point = (300, 1500.0, 48)
    measured = 2 * true_time(A100_14B, *point)
    errors = []
    for _ in range(30):
        errors.append(measured - table.predict(*point))
        table.observe(*point, measured)
    # Each observation closes a quarter of the gap (or more, when a neighbour is pushed up with it).
    for before, after in zip(errors, errors[1:]):
        assert 0 <= after <= 0.75 * before * (1 + 1e-9)
    assert table.predict(*point) == pytest.approx(measured, rel=1e-3)


def test_observing_a_step_on_history_teaches_the_table_the_rest():
    table = LatencyTable(A100_14B)
    shape = StepShape(((4000, 400),), 64, 64 * 1500)
    measured = 1.3 * A100_14B.step_time(((4000, 400),), 64, 1500)
    for _ in range(80):
        table.observe_shape(shape, measured)
    assert table.predict_shape(shape) == pytest.approx(measured, rel=1e-3)
    assert table.num_observations == 80


def test_learning_from_scratch_starts_optimistic_and_learns_a_limit():
    table = LatencyTable()
    assert table.history_cost_s_per_pair == 0 and table.max_prefill(0.1, 1000, 64, limit=2048) == 2048
    rng = random.Random(3)
    for _ in range(3000):  # what a worker runs: decodes with prefill chunks of any size
        pt = (rng.choice([0, 0, rng.randint(1, 2048)]), rng.uniform(500, 2500), rng.randint(1, 128))
        table.observe(*pt, true_time(A100_14B, *pt))
    for d, ctx in ((32, 1000.0), (100, 2000.0)):
        exact = A100_14B.max_prefill_tokens(0.09, decode_batch=d, decode_ctx=ctx)
        assert abs(table.max_prefill(0.09, ctx, d, limit=2048) - exact) <= 0.1 * exact


def test_non_measurements_teach_nothing():
    table = LatencyTable(A100_14B)
    before = [table.predict(p, 1000, 8) for p in (0, 100, 1000)]
    for latency in (0.0, -1.0, math.inf, math.nan):
        table.observe(100, 1000, 8, latency)
    table.observe_shape(StepShape(), 0.5)  # an empty step
    assert [table.predict(p, 1000, 8) for p in (0, 100, 1000)] == before


shapes = st.tuples(st.integers(0, 70_000), st.floats(0, 2e6), st.integers(0, 5000),
                   st.floats(1e-5, 5.0), st.integers(0, 100_000))


@settings(max_examples=60, deadline=None)
@given(seeded=st.booleans(), rate=st.floats(0.01, 1.0), observations=st.lists(shapes, max_size=40),
       queries=st.lists(st.tuples(st.floats(1e-3, 2.0), st.floats(0, 3e5), st.integers(1, 2000)), min_size=1,
                        max_size=10))
def test_whatever_it_observes_the_table_stays_monotone_and_bounded(seeded, rate, observations, queries):
    table = LatencyTable(A100_14B if seeded else None, learning_rate=rate)
    size = len(table)
    for p, ctx, d, latency, history in observations:
        table.observe(p, ctx, d, latency, history_pairs=history)
    assert table.is_monotone() and len(table) == size
    for target, ctx, d in queries:
        m = table.max_prefill(target, ctx, d)
        assert table.max_prefill(target * 1.5, ctx, d) >= m  # more time, no less prefill
        assert table.max_prefill(target, ctx * 2 + 1, d) <= m  # longer contexts, no more
        assert table.max_prefill(target, ctx, d + 1 + d // 3) <= m  # more decodes, no more
        assert table.predict(m, ctx, d) <= target * (1 + 1e-9) or m == 0


def test_memory_is_fixed_however_long_it_learns():
    table = LatencyTable(A100_14B)
    footprint = sys.getsizeof(table._v), len(table)
    rng = random.Random(1)
    for _ in range(20_000):
        pt = (rng.randint(0, 4096), rng.uniform(0, 10_000), rng.randint(0, 512))
        table.observe(*pt, rng.uniform(0.005, 0.5))
    assert (sys.getsizeof(table._v), len(table)) == footprint and table.is_monotone()
    assert not hasattr(table, "__dict__")  # slots only: no per-observation state can pile up


def test_bad_learning_rates_are_refused():
    for rate in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="learning_rate"):
            LatencyTable(learning_rate=rate)
