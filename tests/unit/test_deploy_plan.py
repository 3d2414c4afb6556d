"""The deployment planner (AMPD §5): the ILP against brute force, load curves, inputs, and a
small plan end to end on the real simulator."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.planner.deploy_plan import LOCAL_SHARES, REFINE_TOP, LoadCurve, PlanInputs, plan, solve_plan
from services.planner.simulator import Simulator

INF = math.inf


def brute_force(prefill, decode, gpus):
    pairs = [(p, d, max(prefill[p], decode[d])) for p in prefill for d in decode
             if math.isfinite(prefill[p]) and math.isfinite(decode[d]) and p[0] * p[1] + d[0] * d[1] <= gpus]
    return min((z for _, _, z in pairs), default=None)


costs = st.dictionaries(st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(1, 6)),
                        st.one_of(st.just(INF), st.floats(0.01, 5.0)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(costs, costs, st.integers(2, 40))
def test_the_ilp_finds_the_brute_force_optimum_and_distinct_runners_up(prefill, decode, gpus):
    found = solve_plan(prefill, decode, gpus, top=3)
    best = brute_force(prefill, decode, gpus)
    if best is None:
        assert found == []
        return
    assert found and found[0][2] == pytest.approx(best, rel=1e-6, abs=1e-6)
    assert len({(p, d) for p, d, _ in found}) == len(found)  # each cut off before the next solve
    for p, d, z in found:
        assert p[0] * p[1] + d[0] * d[1] <= gpus
        assert z == max(prefill[p], decode[d])
    assert [z for _, _, z in found] == sorted(z for _, _, z in found)


def test_ties_go_to_the_better_served_other_side_then_to_the_budget():
    prefill = {(4, 1): 2.0}
    decode = {(4, 1): 0.2, (1, 1): 0.5, (2, 2): 0.3, (2, 1): 0.3}
    found = solve_plan(prefill, decode, 8, top=4)
    assert [d for _, d, _ in found] == [(4, 1), (2, 2), (2, 1), (1, 1)]
    assert all(z == 2.0 for _, _, z in found)


def test_a_load_curve_is_monotone_and_infeasible_past_its_last_feasible_point():
    curve = LoadCurve((1.0, 2.0, 3.0, 4.0), (0.1, 0.09, 0.3, INF))
    assert curve.at(0.5) == 0.1  # below the grid: the lowest point
    assert curve.at(2.0) == 0.1  # non-decreasing: the dip at 2.0 is noise
    assert curve.at(2.5) == pytest.approx(0.2)
    assert curve.at(3.0) == pytest.approx(0.3)
    assert curve.at(3.5) == INF
    assert LoadCurve((1.0,), (INF,)).at(0.1) == INF


@pytest.mark.parametrize("kwargs, field", [
    ({"gpus": 1}, "gpus"), ({"gpus": 8, "sessions": "chat"}, "sessions"), ({"gpus": 8, "ttft_slo_ms": 0}, "ttft_slo_ms"),
    ({"gpus": 8, "rate": -1.0}, "rate"), ({"gpus": 8, "tp_degrees": (3,)}, "tp_degrees"), ({"gpus": 8, "top": 0}, "top"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PlanInputs(**kwargs)


def test_a_heterogeneous_simulated_cluster_gives_each_worker_its_own_tp():
    sim = Simulator.from_pools([("prefill", 4, 1), ("decode", 8, 2)], "H100", "Llama-3.1-70B")
    config = sim.config
    assert config.worker_roles == ("prefill", "decode", "decode")
    assert config.kv_blocks_of(1) == config.kv_blocks_of(2) > config.kv_blocks_of(0)
    assert config.perf_model_of(1).prefill_time(0, 2048) < config.perf_model_of(0).prefill_time(0, 2048)
    with pytest.raises(ValueError, match="pools"):
        Simulator.from_pools([("prefill", 4, 0)], "H100", "Llama-3.1-70B")


def test_a_small_plan_end_to_end_stays_in_budget_and_ranks_by_z():
    inputs = PlanInputs(gpus=6, gpu="H100", model="Llama-3-8B", sessions="toolbench", rate=2.0,
                        tp_degrees=(1, 2), sim_sessions=12, top=3)
    result = plan(inputs, processes=1)
    assert set(result.curves["prefill"]) == {1, 2}
    assert set(result.curves["decode"]) == set(result.curves["local_ttft"]) == \
        {(tp, share) for tp in (1, 2) for share in LOCAL_SHARES}
    assert result.candidates
    zs = [c.z for c in result.candidates]
    assert zs == sorted(zs)
    for cand in result.candidates:
        assert cand.gpus <= 6 and cand.prefill_count >= 1 and cand.decode_count >= 1
        assert cand.local_share in LOCAL_SHARES
        assert cand.z == pytest.approx(max(cand.ttft_p95_ms / 350, cand.itl_p95_ms / 40))
    # The refinement pass measured the rates the leading candidates run at, at most two per candidate.
    assert 0 <= result.refined <= 2 * (3 + REFINE_TOP) and result.simulations > result.refined
    assert result.to_dict()["candidates"][0]["label"] == result.candidates[0].label
