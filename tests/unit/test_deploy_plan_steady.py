"""The planner's load-curve points measured at steady state (`steady_window`, `steady_rounds`,
`grows`, `loaded_lifetime_s`): no ramp-up rounds in a point's P95, structural overloads found
before any simulation, and a point on one TP-8 decode worker at 71 sessions/s (256 H100s,
ToolBench: the old plan's top deployment) no longer measured as feasible."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.planner import deploy_plan
from services.planner.deploy_plan import (MAX_POINT_SESSIONS, STEADY_MIN_ROUNDS, PlanInputs, grows,
                                          loaded_lifetime_s, steady_rounds, steady_window)


@dataclasses.dataclass
class Round:
    arrival_s: float
    round_index: int
    ttft_s: float
    tpot_s: float | None = None


SMALL = PlanInputs(gpus=16, gpu="H100", model="Llama-3.1-70B", sessions="toolbench", perf_backend="datasheet")


def test_rounds_before_the_warm_up_and_after_the_last_session_arrived_are_not_measured():
    rounds = [Round(0.0, 0, 1.0), Round(3.0, 1, 2.0), Round(5.0, 0, 3.0), Round(6.0, 0, 4.0),
              Round(9.0, 1, 5.0), Round(10.0, 0, 6.0), Round(12.0, 1, 7.0)]
    kept = steady_rounds(rounds, warmup_s=4.0)
    assert [r.arrival_s for r in kept] == [5.0, 6.0, 9.0, 10.0]  # [0 + 4, last first round at 10]
    assert steady_rounds([Round(1.0, 1, 1.0)], 0.0) == []  # no session's first round: nothing to anchor


def test_a_growing_queue_is_found_and_a_stationary_one_is_not():
    rng = random.Random(3)
    stationary = [Round(t, 0, 0.5 + rng.expovariate(4.0)) for t in range(400)]
    growing = [Round(t, 0, 0.1 + 0.01 * t) for t in range(400)]
    latency = lambda r: r.ttft_s  # noqa: E731
    assert not grows(stationary, latency)
    assert grows(growing, latency)
    assert not grows(growing[:30], latency)  # too few rounds per half to judge
    assert not grows([Round(t, 0, 0.1, None) for t in range(100)], lambda r: r.tpot_s)  # no values


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["decode", "prefill"]), st.sampled_from(SMALL.feasible_tps()), st.sampled_from([0.0, 0.5, 0.75]),
       st.floats(0.05, 80.0))
def test_a_window_is_within_its_bounds_and_keeps_a_measured_part(side, tp, share, rate):
    if side == "prefill":
        share = 0.0
    warmup_s, count = steady_window(SMALL, side, tp, share, rate)
    lifetime = loaded_lifetime_s(SMALL, side, tp, share, rate)
    if lifetime is None:
        assert count is None
        return
    assert SMALL.sim_sessions <= count <= MAX_POINT_SESSIONS
    assert 0 < warmup_s <= lifetime and warmup_s <= 0.5 * count / rate + 1e-9  # at least half measured
    rounds = deploy_plan._session_means(SMALL)[0]
    if count < MAX_POINT_SESSIONS:  # not cut: a lifetime and the minimum rounds measured
        measured_s = count / rate - warmup_s
        assert measured_s >= lifetime - 1 / rate - 1e-9
        assert measured_s * rate * rounds >= STEADY_MIN_ROUNDS - rounds - 1e-6


def test_the_loaded_lifetime_grows_with_load_until_no_steady_state_exists():
    lifetimes = [loaded_lifetime_s(SMALL, "decode", 8, 0.0, rate) for rate in (1.0, 10.0, 30.0, 60.0, 200.0)]
    finite = [x for x in lifetimes if x is not None]
    assert finite == sorted(finite) and len(finite) >= 3
    assert lifetimes[-1] is None  # the running batch would pass max_num_seqs
    # Local prefills that need the whole worker, or a prefill worker past utilisation 1.
    assert loaded_lifetime_s(SMALL, "decode", 8, 0.75, 1e4) is None
    assert loaded_lifetime_s(SMALL, "prefill", 8, 0.0, 1e4) is None
    capacity = deploy_plan.prefill_capacity(SMALL, 8)  # sessions/s at utilisation 1
    queued = [loaded_lifetime_s(SMALL, "prefill", 8, 0.0, load * capacity) for load in (0.01, 0.5, 0.9)]
    assert queued == sorted(queued) and queued[0] > deploy_plan.session_lifetime_s(SMALL, 8)


def test_the_old_top_deployments_decode_point_is_infeasible_and_a_light_one_is_measured():
    inputs = PlanInputs(gpus=256, gpu="H100", model="Llama-3.1-70B", sessions="toolbench", perf_backend="datasheet")
    rate = deploy_plan.default_rate(inputs)
    assert steady_window(inputs, "decode", 8, 0.0, rate) == (0.0, None)
    assert deploy_plan._simulate_point((inputs, ("decode", 8, 0.0, rate))) == (math.inf, math.inf)
    itl, local = deploy_plan._simulate_point((inputs, ("decode", 8, 0.0, 2.0)))
    assert 0 < itl < inputs.itl_slo_ms / 1000 and local == 0.0


def test_a_whole_cluster_check_runs_three_loaded_lifetimes_and_measures_after_the_first():
    rate = 1.0
    candidate = deploy_plan.Candidate(8, 1, 8, 1, z=0.0, ttft_p95_ms=0.0, itl_p95_ms=0.0)
    result = deploy_plan.PlanResult(SMALL, rate, [candidate], {}, 0.0, 0.0)
    (row,) = deploy_plan.check_plan(result, [candidate], sessions=8, processes=1)
    lifetime = loaded_lifetime_s(SMALL, "decode", 8, 0.0, rate)
    assert row["sessions"] == math.ceil(3 * rate * lifetime) > 8
    rounds = deploy_plan._session_means(SMALL)[0]
    assert 0 < row["requests"] < 0.9 * row["sessions"] * rounds  # the warm-up's rounds and the drain's are not counted
    assert row["attainment"] > 0.9
