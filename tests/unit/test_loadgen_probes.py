"""Rate probes: how many requests each sends, whether it reached a steady state, and the options (pure)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TRACES_DIR
from hypothesis import given
from hypothesis import strategies as st

from loadgen import arrivals
from loadgen.bench_config import BenchOptions, build_workload, probe_arrival, resolve_arrival
from loadgen.metrics import RequestResult, Slo
from loadgen.options import check_rate_options, probe_size
from loadgen.probes import ATTAINMENT_DROP, WINDOW_E2E_MULTIPLE, probe_count, steady_state

AZURE = TRACES_DIR / "AzureLLMInferenceTrace_conv.csv"
SLO = Slo(ttft_s=1.0, itl_s=0.1)


# ---- probe_count ------------------------------------------------------------------------------

def test_probe_count_by_hand():
    assert probe_count(0.5, 60, 100) == 100  # 30 arrivals: the floor
    assert probe_count(8, 60, 100) == 480
    assert probe_count(512, 60, 100) == 30_720  # the old fixed 200 covered 0.39 s of arrivals here
    assert probe_count(0.1, 30, 1) == 3  # 0.1 * 30 is 3.0000000000000004 in floating point
    assert probe_count(1.5, 1, 1) == 2


@given(rate=st.floats(1e-3, 1e4), window=st.floats(1e-2, 1e4), floor=st.integers(1, 10_000))
def test_probe_count_covers_the_window_with_the_fewest_requests(rate, window, floor):
    count = probe_count(rate, window, floor)
    assert count >= floor
    assert count >= rate * window * (1 - 1e-9)  # the window is covered ...
    assert count == floor or count - 1 < rate * window  # ... by no more requests than that takes


@pytest.mark.parametrize("args, message", [
    ((0, 60, 100), "rate"), ((math.inf, 60, 100), "rate"), ((1, 0, 100), "--probe-window"),
    ((1, math.nan, 100), "--probe-window"), ((1, 60, 0), "--min-requests"),
])
def test_probe_count_refuses_bad_values_naming_them(args, message):
    with pytest.raises(ValueError, match=message):
        probe_count(*args)


def test_probe_size_window_fixed_count_and_trace_cap():
    windowed = BenchOptions(find_capacity=True, probe_window_s=10, min_requests=20)
    assert probe_size(windowed, 1.0, 100, None) == (20, False)
    assert probe_size(windowed, 7.0, 100, None) == (70, False)
    assert probe_size(windowed, 7.0, 100, 50) == (50, True)  # the trace holds only 50 rows
    fixed = BenchOptions(find_capacity=True, probe_window_s=0, num_requests=200)
    assert probe_size(fixed, 1.0, 200, None) == probe_size(fixed, 500.0, 200, None) == (200, False)


# ---- options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("opts, message", [
    (BenchOptions(find_capacity=True, num_requests=200), r"-n/--num-requests 200: .*--probe-window 0"),
    (BenchOptions(sweep_rates=[1.0], num_requests=5), r"--min-requests 5 instead"),
    (BenchOptions(find_capacity=True, sessions="gaia", num_sessions=3), r"--num-sessions 3"),
    (BenchOptions(find_capacity=True, probe_window_s=-1), r"--probe-window: must be .* >= 0"),
    (BenchOptions(find_capacity=True, probe_window_s=math.inf), r"--probe-window"),
    (BenchOptions(sweep_rates=[1.0], min_requests=0), r"--min-requests: must be >= 1"),
])
def test_rate_modes_refuse_a_fixed_count_beside_the_window_and_bad_values(opts, message):
    with pytest.raises(ValueError, match=message):
        check_rate_options(opts)


def test_a_fixed_count_is_fine_without_the_window_or_outside_rate_modes():
    check_rate_options(BenchOptions(find_capacity=True, num_requests=200, probe_window_s=0))
    check_rate_options(BenchOptions(num_requests=200))
    check_rate_options(BenchOptions(find_capacity=True))


# ---- workloads make a probe's count -----------------------------------------------------------

def test_shapes_and_sessions_make_the_count_asked_for():
    shapes = build_workload(BenchOptions(shapes=["P8/D2"]))
    assert shapes.count == 100 and shapes.max_count is None
    assert len(shapes.make_items("t", 256)) == 100 and len(shapes.make_items("t", 256, 7)) == 7
    sessions = build_workload(BenchOptions(sessions="hotpotqa", length_scale=0.02, tool_delay="none"))
    assert sessions.count == 10 and len(sessions.make_items("t", 256, 3)) == 3


@pytest.mark.skipif(not AZURE.exists(), reason="shared traces not present")
def test_a_trace_makes_its_first_rows_and_replays_them_at_the_probe_rate():
    opts = BenchOptions(trace=AZURE, length_scale=0.1, find_capacity=True)
    workload = build_workload(opts)
    assert workload.count == 100 and workload.max_count == len(workload.trace_timestamps) > 1000
    items = workload.make_items("t", 256, 1000)
    assert len(items) == 1000 and len(workload.make_items("t", 256, 10**9)) == workload.max_count
    process = probe_arrival(resolve_arrival(opts, workload), 25.0, 1000, workload)
    offsets = process.offsets(1000, np.random.default_rng(0))
    assert 999 / offsets[-1] == pytest.approx(25.0)  # the 1,000 rows arrive at 25/s on average


def test_probe_arrival_keeps_other_kinds():
    workload = build_workload(BenchOptions())
    assert probe_arrival(arrivals.gamma(1.0, 0.5), 4.0, 10, workload) == arrivals.GammaArrivals(4.0, 0.5)
    assert probe_arrival(None, 4.0, 10, workload) == arrivals.PoissonArrivals(4.0)


# ---- steady_state -----------------------------------------------------------------------------

def _request(i: int, arrival: float, ttft: float, e2e: float, gap: float = 0.05) -> RequestResult:
    first = arrival + ttft
    times = [first, first + gap]
    return RequestResult(f"r{i}", None, 0, arrival, first, times, arrival + e2e, 10, 2, True)


def test_a_long_window_with_flat_latency_is_steady():
    results = [_request(i, i * 1.0, 0.2, 5.0) for i in range(20)]  # window 19 s, E2E 5 s
    check = steady_state(results, SLO)
    assert check.steady and check.reasons == ()
    assert check.arrival_window_s == 19 and check.median_e2e_s == 5.0
    assert check.attainment_earlier_half == check.attainment_later_half == 1.0
    assert check.to_dict()["reasons"] == []


def test_a_window_under_twice_the_median_e2e_is_short():
    # The bug's shape: 200 requests in 0.39 s, each taking ~45 s.
    results = [_request(i, i * 0.39 / 199, 0.3, 45.0) for i in range(200)]
    check = steady_state(results, SLO)
    assert not check.steady and check.reasons[0].startswith("short window")
    # Just at the multiple it is not.
    edge = [_request(i, i * 1.0, 0.2, 19.0 / WINDOW_E2E_MULTIPLE) for i in range(20)]
    assert steady_state(edge, SLO).steady


def test_later_arrivals_missing_more_is_a_growing_queue():
    # TTFT grows with arrival time: the earlier half all meet the 1 s TTFT, 30% of the later half miss it.
    results = [_request(i, i * 1.0, 0.2 if i < 14 else 2.0, 3.0) for i in range(20)]
    check = steady_state(results, SLO)
    assert check.attainment_earlier_half == 1.0 and check.attainment_later_half == pytest.approx(0.4)
    assert not check.steady and any(r.startswith("growing queue") for r in check.reasons)
    # A drop of no more than ATTAINMENT_DROP is noise, not a trend.
    one_miss = [_request(i, i * 1.0, 2.0 if i == 19 else 0.2, 3.0) for i in range(20)]
    assert 1.0 - steady_state(one_miss, SLO).attainment_later_half <= ATTAINMENT_DROP
    assert steady_state(one_miss, SLO).steady


def test_no_successful_request_or_too_few_to_halve():
    failed = [RequestResult(f"r{i}", None, 0, float(i), None, [], float(i), 10, 0, False, "x") for i in range(6)]
    check = steady_state(failed, SLO)
    assert math.isnan(check.median_e2e_s) and check.to_dict()["median_e2e_s"] is None
    assert check.steady  # nothing passes: nothing to warn about
    few = steady_state([_request(0, 0.0, 0.1, 1.0)], SLO)
    assert math.isnan(few.attainment_later_half) and not few.steady  # window 0 < 2 x 1 s
