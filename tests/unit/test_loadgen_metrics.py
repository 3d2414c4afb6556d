"""Metrics on hand-computed examples, and the capacity search on synthetic curves."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.metrics import (
    Distribution,
    RequestResult,
    Slo,
    find_capacity,
    meets_slo,
    summarize,
)


def _results() -> list[RequestResult]:
    return [
        # TTFT 0.5, gaps [0.1, 0.2, 0.2], TPOT 0.5/3, TBT p99 0.2, E2E 1.0
        RequestResult("a", None, 0, 0.0, 0.5, [0.5, 0.6, 0.8, 1.0], 1.0, 10, 4, True),
        # Incremental round: TTFT 0.2, gap [0.3], TPOT 0.3, TBT p99 0.3, E2E 0.5
        RequestResult("b", "s", 1, 1.0, 1.2, [1.2, 1.5], 1.5, 5, 2, True),
        RequestResult("c", None, 0, 0.5, None, [], 2.0, 7, 0, False, "UNAVAILABLE"),
    ]


def test_per_request_metrics():
    a, b, c = _results()
    assert a.ttft_s == 0.5 and c.ttft_s is None
    assert a.itls_s == pytest.approx([0.1, 0.2, 0.2])
    assert a.tpot_s == pytest.approx(0.5 / 3)
    assert a.tbt_p99_s == pytest.approx(0.2)
    assert b.tbt_p99_s == pytest.approx(0.3)
    assert a.e2e_s == 1.0 and b.e2e_s == 0.5
    single = RequestResult("d", None, 0, 0.0, 0.1, [0.1], 0.1, 1, 1, True)
    assert single.tpot_s is None and single.tbt_p99_s is None


def test_summary_against_hand_computed_values():
    s = summarize(_results(), Slo(ttft_s=0.6, itl_s=0.31))
    assert (s.n_requests, s.n_ok, s.n_failed, s.n_meeting_slo) == (3, 2, 1, 2)
    assert s.span_s == 2.0
    assert s.request_throughput == pytest.approx(1.0)
    assert s.input_token_throughput == pytest.approx(7.5)
    assert s.output_token_throughput == pytest.approx(3.0)
    assert s.goodput_tokens_per_s == pytest.approx(3.0)
    assert s.goodput_requests_per_s == pytest.approx(1.0)
    assert s.slo_attainment == pytest.approx(2 / 3)
    assert (s.ttft.count, s.ttft.mean) == (2, pytest.approx(0.35))
    assert (s.ttft_initial.count, s.ttft_initial.p50) == (1, 0.5)
    assert (s.ttft_incremental.count, s.ttft_incremental.p50) == (1, pytest.approx(0.2))
    # Pooled gaps [0.1, 0.2, 0.2, 0.3]; linear percentiles: p90 at rank 2.7, p99 at 2.97.
    assert s.itl.count == 4
    assert s.itl.mean == pytest.approx(0.2)
    assert s.itl.p50 == pytest.approx(0.2)
    assert s.itl.p90 == pytest.approx(0.27)
    assert s.itl.p99 == pytest.approx(0.297)
    assert s.itl.max == pytest.approx(0.3)
    assert s.tpot.mean == pytest.approx((0.5 / 3 + 0.3) / 2)
    assert s.tbt_p99.count == 2 and s.tbt_p99.max == pytest.approx(0.3)
    assert s.e2e.mean == pytest.approx(0.75)
    assert s.errors == {"UNAVAILABLE": 1}


@pytest.mark.parametrize(
    "slo, meeting, goodput",
    [
        (Slo(0.4, 0.25), [False, False, False], 0.0),  # a: TTFT 0.5 > 0.4; b: TBT 0.3 > 0.25
        (Slo(0.6, 0.25), [True, False, False], 2.0),
        (Slo(0.6, 0.3, incremental_ttft_s=0.1), [True, False, False], 2.0),  # b: TTFT 0.2 > 0.1
        (Slo(0.45, 0.31, incremental_ttft_s=0.25), [False, True, False], 1.0),
    ],
)
def test_slo_checks_and_goodput(slo, meeting, goodput):
    results = _results()
    assert [meets_slo(r, slo) for r in results] == meeting
    s = summarize(results, slo)
    assert s.goodput_tokens_per_s == pytest.approx(goodput)
    assert s.slo_attainment == pytest.approx(sum(meeting) / 3)


def test_tbt_slo_uses_the_per_request_p99_not_the_max():
    # 199 gaps of 10 ms and one 1 s stall: the p99 (rank 197.01 of 0..198) is still 10 ms.
    times = np.concatenate([[0.0], np.cumsum([0.01] * 199 + [1.0])]).tolist()
    r = RequestResult("x", None, 0, 0.0, 0.0, times, times[-1], 1, 200, True)
    assert r.tbt_p99_s == pytest.approx(0.01)
    assert r.itls_s.max() == pytest.approx(1.0)
    assert meets_slo(r, Slo(0.1, 0.05))


def test_max_gap_slo_catches_the_stall_the_p99_hides():
    # The same request as above: one 1 s stall among 200 gaps, e.g. a wait for a decode slot.
    times = np.concatenate([[0.0], np.cumsum([0.01] * 199 + [1.0])]).tolist()
    r = RequestResult("x", None, 0, 0.0, 0.0, times, times[-1], 1, 200, True)
    assert r.max_gap_s == pytest.approx(1.0)
    assert meets_slo(r, Slo(0.1, 0.05, max_gap_s=1.5))
    assert not meets_slo(r, Slo(0.1, 0.05, max_gap_s=0.5))
    # With fewer than 2 tokens there is no gap to check.
    single = RequestResult("d", None, 0, 0.0, 0.1, [0.1], 0.1, 1, 1, True)
    assert single.max_gap_s is None and meets_slo(single, Slo(0.2, 0.05, max_gap_s=0.001))
    # Hand-computed run: a's largest gap is 0.2 s, b's 0.3 s.
    s = summarize(_results(), Slo(0.6, 0.31, max_gap_s=0.25))
    assert s.n_meeting_slo == 1 and s.goodput_tokens_per_s == pytest.approx(2.0)


def test_to_dict_is_strict_json_and_empty_runs_give_none():
    json.dumps(summarize(_results(), Slo(0.6, 0.31)).to_dict(), allow_nan=False)
    empty = summarize([], Slo(1.0, 0.1)).to_dict()
    json.dumps(empty, allow_nan=False)
    assert empty["n_requests"] == 0 and empty["slo_attainment"] is None
    assert empty["ttft"]["p99"] is None and empty["slo"]["ttft_s"] == 1.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50))
def test_distribution_matches_numpy_linear_percentiles(values):
    d = Distribution.of(values)
    assert d.count == len(values)
    for q, got in ((50, d.p50), (90, d.p90), (95, d.p95), (99, d.p99)):
        assert got == np.percentile(values, q, method="linear")
    assert d.max == max(values)


def _step(capacity: float):
    return lambda rate: 1.0 if rate <= capacity else 0.0


def test_capacity_expands_the_bracket_upwards_then_bisects():
    result = find_capacity(_step(7.3), target=0.9, lo=1.0, hi=2.0, tol=0.05, max_iters=30)
    assert result.converged
    assert 7.3 - 0.05 <= result.rate <= 7.3 < result.fail_rate <= result.rate + 0.05
    assert [p.rate for p in result.probes[:4]] == [1.0, 2.0, 4.0, 8.0]
    assert all(p.passed == (p.rate <= 7.3) for p in result.probes)
    json.dumps(result.to_dict(), allow_nan=False)


def test_capacity_expands_the_bracket_downwards():
    result = find_capacity(_step(0.7), target=0.9, lo=5.0, hi=10.0, tol=0.01, max_iters=30)
    assert [p.rate for p in result.probes[:4]] == [5.0, 2.5, 1.25, 0.625]
    assert result.converged and 0.69 <= result.rate <= 0.7


def test_capacity_on_a_smooth_curve():
    attainment = lambda rate: 1.0 / (1.0 + math.exp(rate - 5.0))  # noqa: E731
    result = find_capacity(attainment, target=0.5, lo=1.0, hi=3.0, tol=0.01, max_iters=30)
    assert result.rate == pytest.approx(5.0, abs=0.01)


def test_capacity_when_nothing_passes_and_when_the_budget_runs_out():
    never = find_capacity(lambda r: 0.0, target=0.9, lo=1.0, hi=2.0, tol=0.1, max_iters=30)
    assert never.rate == 0.0 and never.converged and never.fail_rate <= 0.1
    short = find_capacity(_step(100.0), target=0.9, lo=1.0, hi=2.0, tol=0.01, max_iters=3)
    assert len(short.probes) == 3 and not short.converged
    assert short.rate == 4.0 and math.isinf(short.fail_rate)
    assert short.to_dict()["fail_rate"] is None
    with pytest.raises(ValueError, match="lo/hi"):
        find_capacity(_step(1.0), 0.9, lo=2.0, hi=1.0)


def test_capacity_search_stops_at_max_rate():
    # A system whose SLO never fails (or cannot see it fail) must not be probed at ever
    # higher, ever costlier rates: the search ends at max_rate and says it was capped.
    probed = []
    result = find_capacity(lambda r: probed.append(r) or 1.0, target=0.9, lo=1.0, hi=2.0, tol=0.01,
                           max_iters=30, max_rate=10.0)
    assert probed == [1.0, 2.0, 4.0, 8.0, 10.0]
    assert result.capped and result.rate == 10.0 and math.isinf(result.fail_rate) and not result.converged
    assert result.to_dict()["capped"] is True
    # Below the cap the search is unchanged.
    below = find_capacity(_step(7.3), target=0.9, lo=1.0, hi=2.0, tol=0.05, max_iters=30, max_rate=10.0)
    assert below.converged and not below.capped and 7.25 <= below.rate <= 7.3 < below.fail_rate
    with pytest.raises(ValueError, match="max_rate"):
        find_capacity(_step(1.0), 0.9, lo=1.0, hi=4.0, max_rate=3.0)


@settings(max_examples=50, deadline=None)
@given(capacity=st.floats(0.2, 500.0), lo=st.floats(0.1, 50.0), tol=st.floats(0.001, 1.0))
def test_capacity_brackets_any_step(capacity, lo, tol):
    result = find_capacity(_step(capacity), target=0.99, lo=lo, hi=lo * 2, tol=tol, max_iters=200)
    assert result.converged
    assert result.rate <= capacity < result.fail_rate
    assert result.fail_rate - result.rate <= tol
