"""Arrival processes: rates, variability, determinism, trace replay and spec parsing."""


import numpy as np
import pytest
from conftest import TRACES_DIR, needs_traces
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.arrivals import (
    ConstantArrivals,
    GammaArrivals,
    PoissonArrivals,
    TraceArrivals,
    constant,
    gamma,
    parse_arrival,
    poisson,
    trace,
)

N = 200_000


def _rate_and_cv(offsets: np.ndarray) -> tuple[float, float]:
    gaps = np.diff(offsets)
    return 1.0 / gaps.mean(), gaps.std() / gaps.mean()


def test_poisson_mean_rate_and_unit_cv():
    rate, cv = _rate_and_cv(poisson(4.0).offsets(N, np.random.default_rng(1)))
    assert rate == pytest.approx(4.0, rel=0.02)
    assert cv == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_gamma_keeps_rate_and_has_cv_one_over_sqrt_burstiness(burstiness):
    rate, cv = _rate_and_cv(gamma(3.0, burstiness).offsets(N, np.random.default_rng(2)))
    assert rate == pytest.approx(3.0, rel=0.02)
    assert cv == pytest.approx(1.0 / np.sqrt(burstiness), rel=0.04)


def test_constant_is_exact():
    offsets = constant(2.0).offsets(5, np.random.default_rng(0))
    assert offsets.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    big = constant(3.0).offsets(1000, np.random.default_rng(0))
    assert np.array_equal(big, np.arange(1000) / 3.0)


@pytest.mark.parametrize("process", [poisson(5.0), gamma(5.0, 0.3), constant(5.0)])
def test_deterministic_under_seed(process):
    a = process.offsets(100, np.random.default_rng(42))
    b = process.offsets(100, np.random.default_rng(42))
    assert np.array_equal(a, b)


def test_different_seeds_differ():
    a = poisson(5.0).offsets(100, np.random.default_rng(1))
    b = poisson(5.0).offsets(100, np.random.default_rng(2))
    assert not np.array_equal(a, b)


@settings(max_examples=50, deadline=None)
@given(
    kind=st.sampled_from(["poisson", "gamma", "constant"]),
    rate=st.floats(0.01, 1000.0),
    burstiness=st.floats(0.05, 20.0),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_offsets_start_at_zero_and_never_decrease(kind, rate, burstiness, n, seed):
    process = {"poisson": poisson(rate), "gamma": gamma(rate, burstiness), "constant": constant(rate)}[kind]
    offsets = process.offsets(n, np.random.default_rng(seed))
    assert offsets.shape == (n,)
    if n:
        assert offsets[0] == 0.0
        assert np.all(np.diff(offsets) >= 0)
        assert np.all(np.isfinite(offsets))


def test_infinite_rate_sends_everything_at_once():
    for process in (poisson(float("inf")), gamma(float("inf"), 0.5), constant(float("inf"))):
        assert np.array_equal(process.offsets(4, np.random.default_rng(0)), np.zeros(4))


def test_trace_replay_time_scale_is_a_speedup():
    ts = [10.0, 11.0, 13.0, 13.0, 20.0]
    assert trace(ts).offsets(5, None).tolist() == [0.0, 1.0, 3.0, 3.0, 10.0]
    assert trace(ts, time_scale=2.0).offsets(3, None).tolist() == [0.0, 0.5, 1.5]
    assert trace(ts).offsets(0, None).shape == (0,)


def test_trace_rejects_bad_input():
    with pytest.raises(ValueError, match="n"):
        trace([0.0, 1.0]).offsets(3, None)
    with pytest.raises(ValueError, match="timestamps"):
        trace([1.0, 0.0])
    with pytest.raises(ValueError, match="time_scale"):
        trace([0.0], time_scale=0.0)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("poisson:rate=4", PoissonArrivals(4.0)),
        ("gamma:rate=4,burstiness=0.5", GammaArrivals(4.0, 0.5)),
        ("gamma:rate=4", GammaArrivals(4.0, 1.0)),
        (" Gamma : burstiness = 2 , rate = 1.5 ", GammaArrivals(1.5, 2.0)),
        ("constant:rate=2", ConstantArrivals(2.0)),
        ("poisson:rate=inf", PoissonArrivals(float("inf"))),
    ],
)
def test_parse_arrival(spec, expected):
    assert parse_arrival(spec) == expected


@pytest.mark.parametrize(
    "spec, field",
    [
        ("poisson", "rate"),
        ("poisson:rate=abc", "rate"),
        ("poisson:rate=-1", "rate"),
        ("poisson:rate=0", "rate"),
        ("poisson:rate=nan", "rate"),
        ("poisson:rat=4", "rat"),
        ("poisson:rate=4,burstiness=2", "burstiness"),
        ("gamma:rate=4,burstiness=x", "burstiness"),
        ("gamma:rate=4,burstiness=0", "burstiness"),
        ("gamma:rate=4,rate=5", "rate"),
        ("gamma:rate", "rate"),
        ("weibull:rate=1", "kind"),
        ("trace:time_scale=2", "path"),
    ],
)
def test_parse_arrival_errors_name_the_field(spec, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        parse_arrival(spec)


@needs_traces
def test_parse_arrival_trace_reads_timestamps():
    process = parse_arrival(f"trace:path={TRACES_DIR / 'mooncake_synthetic_trace.jsonl'},time_scale=2")
    assert isinstance(process, TraceArrivals)
    assert len(process.timestamps) == 3993
    offsets = process.offsets(3, None)
    assert offsets.tolist() == [0.0, 0.0, 0.02]  # 0 ms, 0 ms, 40 ms at double speed
