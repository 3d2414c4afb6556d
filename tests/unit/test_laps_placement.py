"""LAPS spatial mode: the `laps` placement policy (short/long pools by L_m(H), long overflow)
and the instance-pressure controller (Alg. 2) over hand-made views, and both in the simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.global_scheduler.laps import LapsPlacementPolicy
from services.global_scheduler.policy import ClusterView, PlacementRequest, WorkerSignals, WorkerView, make_policy
from services.global_scheduler.pool_controller import PoolController, PoolControllerConfig, PoolMove, percentile
from services.planner.sim_workload import SimRequestSpec
from services.planner.simulator import Simulator, pd_roles
from splitserve.core.length_class import DEFAULT_BOUNDARY_TOKENS, LengthBoundary
from splitserve.perf.model import DecodeCoeffs, PerfModel, PrefillCoeffs, TransferCoeffs
from splitserve.core.records import WorkerLoad

NOW = 1_700_000_000.0
# A roofline: compute 1e-5 s per token, memory (weights) 2 ms a step: L_m(0) = 200 tokens.
TOY = PerfModel(PrefillCoeffs(c_tok=1e-5, m0=2e-3), DecodeCoeffs(c0=2e-3, c_seq=1e-4),
                TransferCoeffs(latency=1e-4, per_token=1e-6), kv_bytes_per_token=1024)


def worker(worker_id: str, role: str = "prefill", pool: str = "", *, queued: int = 0, busy: float = 0.0,
           ttft: float | None = None, draining: bool = False, running: int = 0, l_m: float = 0.0) -> WorkerView:
    load = WorkerLoad(worker_id, role=role, engine_kind="simulated", free_blocks=100, total_blocks=100,
                      block_size=16, queued_prefill_tokens=queued, running=running, draining=draining,
                      updated_unix=NOW, pool=pool, busy_fraction=busy, length_boundary=l_m)
    return WorkerView(worker_id, f"{worker_id}:1", load, signals=WorkerSignals(ttft, None, ()))


def view(*workers: WorkerView) -> ClusterView:
    return ClusterView(tuple(workers), NOW)


def request(prompt_len: int, history: int = 0, bound: str = "", max_tokens: int = 8) -> PlacementRequest:
    return PlacementRequest("r", prompt_len, max_tokens, session_id="s" if history else "", history_len=history,
                            bound_worker=bound)


# ---- the boundary -------------------------------------------------------------------------
def test_the_boundary_is_the_roofline_ridge_and_moves_with_history():
    boundary = LengthBoundary(TOY)
    assert boundary.tokens(0) == pytest.approx(200.0)
    assert boundary.is_short(199) and not boundary.is_short(200)
    assert LengthBoundary().tokens(5000) == DEFAULT_BOUNDARY_TOKENS  # no model: LAPS' typical value
    assert LengthBoundary(TOY, 64).tokens(0) == 64  # a fixed count wins
    with pytest.raises(ValueError, match="boundary_tokens"):
        LengthBoundary(TOY, 0)
    reading_history = PerfModel(PrefillCoeffs(c_tok=1e-5, m0=2e-3, m_hist=1e-6), DecodeCoeffs(c0=2e-3),
                                TransferCoeffs(), kv_bytes_per_token=1024)
    # Reading H cached tokens' KV raises the memory term: a re-prefill turns compute-bound later.
    assert LengthBoundary(reading_history).tokens(4096) > LengthBoundary(reading_history).tokens(0)


# ---- placement ------------------------------------------------------------------------------
def test_registered_and_parameters_are_checked_by_name():
    assert isinstance(make_policy("laps", deployment_perf_model=TOY), LapsPlacementPolicy)
    for bad, name in ((dict(hysteresis=-1), "hysteresis"), (dict(min_per_pool=0), "min_per_pool"),
                      (dict(ttft_slo_ms="x"), "ttft_slo_ms"), (dict(boundary_tokens=0), "boundary_tokens"),
                      (dict(overflow_ms=-5), "overflow_ms"), (dict(controller="maybe"), "controller"),
                      (dict(follow_workers="2"), "follow_workers")):
        with pytest.raises(ValueError, match=name):
            LapsPlacementPolicy(perf_model=TOY, **bad)


def test_short_and_long_prefills_go_to_their_pools_and_decode_behind():
    policy = LapsPlacementPolicy(perf_model=TOY)
    cluster = view(worker("p0", pool="short"), worker("p1", pool="long"), worker("d0", "decode"))
    short = policy.place(request(150), cluster, NOW)
    assert short.worker_ids == ("p0", "d0") and short.stages[0].end == 150
    assert short.decision["short"] == 1.0 and short.decision["l_m"] == pytest.approx(200.0)
    long = policy.place(request(5000), cluster, NOW)
    assert long.worker_ids == ("p1", "d0") and long.decision["short"] == 0.0


def test_a_re_prefill_is_classified_by_its_new_tokens_on_its_history_and_decodes_where_it_is_bound():
    policy = LapsPlacementPolicy(perf_model=TOY)
    cluster = view(worker("p0", pool="short"), worker("p1", pool="long"), worker("d0", "decode", running=9),
                   worker("d1", "decode"))
    placement = policy.place(request(5100, history=5000, bound="d0"), cluster, NOW)  # 100 new tokens
    assert placement.worker_ids == ("p0", "d0")


def test_within_a_pool_the_smallest_predicted_backlog_wins_counting_what_was_placed_since_the_snapshot():
    policy = LapsPlacementPolicy(perf_model=TOY, overflow_ms=1e9)
    cluster = view(worker("p0", pool="long", queued=3000), worker("p1", pool="long", queued=1000),
                   worker("p2", pool="short"), worker("d0", "decode"))
    assert policy.place(request(5000), cluster, NOW).worker_ids[0] == "p1"
    # p1 now holds 6000 tokens by this scheduler's count; the snapshot still says 1000.
    assert policy.place(request(5000), cluster, NOW).worker_ids[0] == "p0"


def test_long_prefills_overflow_to_the_short_pool_when_theirs_is_backed_up_shorts_never_leave_theirs():
    policy = LapsPlacementPolicy(perf_model=TOY, overflow_ms=10)
    cluster = view(worker("p0", pool="short", queued=500), worker("p1", pool="long", queued=20_000),
                   worker("d0", "decode"))
    long = policy.place(request(3000), cluster, NOW)
    assert long.worker_ids[0] == "p0" and long.decision["overflow"] == 1.0
    busy_short_pool = view(worker("p0", pool="short", queued=50_000), worker("p1", pool="long"),
                           worker("d0", "decode"))
    assert policy.place(request(100), busy_short_pool, NOW).worker_ids[0] == "p0"
    strict = LapsPlacementPolicy(perf_model=TOY, overflow_ms=1e9)  # the paper's strict pools
    assert strict.place(request(3000), cluster, NOW).worker_ids[0] == "p1"


def test_without_a_pool_of_its_class_a_request_goes_to_unpooled_then_any_prefill_worker():
    policy = LapsPlacementPolicy(perf_model=TOY)
    unpooled = view(worker("p0", pool="long"), worker("p1"), worker("d0", "decode"))
    placement = policy.place(request(50), unpooled, NOW)
    assert placement.worker_ids[0] == "p1" and placement.decision["pool_fallback"] == 1.0
    only_long = view(worker("p0", pool="long"), worker("d0", "decode"))
    assert policy.place(request(50), only_long, NOW).worker_ids[0] == "p0"
    draining_short = view(worker("p0", pool="short", draining=True), worker("p1", pool="long"),
                          worker("d0", "decode"))
    assert policy.place(request(50), draining_short, NOW).worker_ids[0] == "p1"


def test_without_prefill_workers_it_is_temporal_mode_colocated():
    policy = LapsPlacementPolicy(perf_model=TOY)
    placement = policy.place(request(50), view(worker("b0", "both", running=3), worker("b1", "both")), NOW)
    assert placement.worker_ids == ("b1",) and placement.stages[0].end == 58
    no_decode = policy.place(request(50), view(worker("p0", pool="short")), NOW)
    assert no_decode.worker_ids == ("p0",)


# ---- the controller ---------------------------------------------------------------------------
def controller(**options) -> PoolController:
    return PoolController(PoolControllerConfig(**{"ttft_slo_s": 0.4, "cool_down_s": 5.0, **options}), TOY)


def test_config_checks_name_the_field():
    for bad, name in ((dict(period_s=0), "period_s"), (dict(min_per_pool=0), "min_per_pool"),
                      (dict(percentile=0), "percentile"), (dict(gamma=-1), "gamma"), (dict(hysteresis=math.nan),
                                                                                      "hysteresis")):
        with pytest.raises(ValueError, match=name):
            PoolControllerConfig(**bad)


def test_pressure_is_queue_plus_sla_deviation_minus_spare_capacity():
    ctl = controller(alpha=1.0, beta=2.0, gamma=0.5)
    p = ctl.pressure(worker("p0", pool="short", queued=1000, busy=0.75, ttft=0.6))
    assert p.queue == pytest.approx(TOY.prefill_time(0, 1000) / 0.4)
    assert p.sla_deviation == pytest.approx(0.5) and p.spare == pytest.approx(0.25)
    assert p.pressure == pytest.approx(p.queue + 2 * 0.5 - 0.5 * 0.25)
    within = ctl.pressure(worker("p0", ttft=0.1))
    assert within.sla_deviation == 0.0 and within.pressure == pytest.approx(-0.5)


def test_unpooled_prefill_workers_are_assigned_to_the_smaller_pool_short_first_and_not_counted_as_moves():
    ctl = controller()
    decision = ctl.step(view(worker("p0"), worker("p1"), worker("p2"), worker("d0", "decode")), NOW)
    assert decision.assignments == (PoolMove("p0", "", "short"), PoolMove("p1", "", "long"),
                                    PoolMove("p2", "", "short"))
    assert decision.move is None and ctl.num_moves == 0
    assert controller().step(view(worker("p0"), worker("d0", "decode")), NOW).changes == ()  # one: temporal mode


def test_one_instance_moves_to_the_pressed_pool_the_least_pressed_donor_then_cool_down():
    ctl = controller()
    cluster = view(worker("p0", pool="short", queued=40_000, busy=1.0), worker("p1", pool="long", busy=0.5),
                   worker("p2", pool="long", busy=0.1), worker("p3", pool="long", busy=0.9, queued=2000))
    decision = ctl.step(cluster, NOW)
    assert decision.move == PoolMove("p2", "long", "short")  # the most spare of the long pool
    assert decision.short_pressure > decision.long_pressure
    assert ctl.step(cluster, NOW + 4.9).move is None  # T_cool
    assert ctl.step(cluster, NOW + 5.0).move is not None


def test_a_move_whose_set_role_failed_neither_counts_nor_starts_a_cool_down():
    ctl = controller()
    cluster = view(worker("p0", pool="short", queued=40_000, busy=1.0), worker("p1", pool="long", busy=0.5),
                   worker("p2", pool="long", busy=0.1))
    first = ctl.step(cluster, NOW)
    assert first.move is not None and ctl.num_moves == 1
    ctl.move_failed()
    assert ctl.num_moves == 0
    assert ctl.step(cluster, NOW + 1.0).move == first.move  # decided again at once, no cool-down
    assert ctl.step(cluster, NOW + 2.0).move is None  # that one happened: T_cool from NOW + 1


def test_hysteresis_min_gap_and_n_min_hold_moves_back():
    balanced = view(worker("p0", pool="short", queued=10_000, busy=1.0), worker("p1", pool="long", queued=9000,
                                                                                busy=1.0),
                    worker("p2", pool="long", queued=9000, busy=1.0))
    assert controller().step(balanced, NOW).move is None  # within τ
    idle = view(worker("p0", pool="short"), worker("p1", pool="long", busy=0.2), worker("p2", pool="long"))
    assert controller().step(idle, NOW).move is None  # two idle pools: clipped at 0, under min_gap
    at_min = view(worker("p0", pool="short", queued=40_000, busy=1.0), worker("p1", pool="long"))
    assert controller().step(at_min, NOW).move is None  # the long pool is at n_min


def test_the_donor_guard_refuses_a_move_its_pool_could_not_absorb():
    # Two short instances 60% busy each keep up; the long pool's pressure spike would take one
    # (Alg. 2 as published), leaving one instance 120% busy. The guard (the laps policy's default) refuses that.
    spike = view(worker("s0", pool="short", busy=0.6), worker("s1", pool="short", busy=0.6),
                 worker("l0", pool="long", queued=60_000, busy=1.0), worker("l1", pool="long", queued=60_000, busy=1.0))
    assert controller().step(spike, NOW).move.to_pool == "long"
    assert controller(max_donor_busy=0.9).step(spike, NOW).move is None
    idle_short = view(worker("s0", pool="short", busy=0.2), worker("s1", pool="short", busy=0.3),
                      worker("l0", pool="long", queued=60_000, busy=1.0), worker("l1", pool="long", queued=60_000, busy=1.0))
    assert controller(max_donor_busy=0.9).step(idle_short, NOW).move.to_pool == "long"  # 0.5 fits one instance
    with pytest.raises(ValueError, match="max_donor_busy"):
        PoolControllerConfig(max_donor_busy=0.0)


def test_the_laps_policy_builds_its_controller_with_the_donor_guard_unless_told_inf():
    assert make_policy("laps").pool_controller().config.max_donor_busy == 0.9
    for off in ("inf", "none", "off", None, math.inf):
        assert make_policy("laps", max_donor_busy=off).pool_controller().config.max_donor_busy == math.inf
    assert make_policy("laps", max_donor_busy="0.75").pool_controller().config.max_donor_busy == 0.75
    for bad in ("0", "-1", "busy", "nan", "-inf"):
        with pytest.raises(ValueError, match="max_donor_busy"):
            make_policy("laps", max_donor_busy=bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["short", "long", ""]), st.integers(0, 60_000), st.floats(0, 1),
                          st.one_of(st.none(), st.floats(0, 3))), min_size=0, max_size=9),
       st.integers(1, 3), st.floats(0, 1))
def test_the_controller_never_breaks_its_invariants(specs, n_min, tau):
    """Whatever the signals: at most one move per decision, never below n_min, every unpooled
    prefill worker assigned, no move within the cool-down, pool pressures >= 0."""
    ctl = controller(min_per_pool=n_min, hysteresis=tau)
    workers = [worker(f"p{i}", pool=pool, queued=q, busy=b, ttft=t) for i, (pool, q, b, t) in enumerate(specs)]
    decision = ctl.step(view(*workers), NOW)
    if len(workers) < 2 * n_min:
        assert decision.changes == ()
        return
    assert decision.short_pressure >= 0 and decision.long_pressure >= 0
    pools = {w.worker_id: w.load.pool for w in workers}
    assert {a.worker_id for a in decision.assignments} == {w for w, p in pools.items() if p == ""}
    for change in decision.changes:
        pools[change.worker_id] = change.to_pool
    sizes = sorted((list(pools.values()).count("short"), list(pools.values()).count("long")))
    if decision.move is not None:
        # A pressure move keeps both pools at n_min; a refill raises the smaller one by one.
        before = sorted(list(p for w, p in pools.items() if w != decision.move.worker_id).count(x) +
                        (x == decision.move.from_pool) for x in ("short", "long"))
        assert sizes[0] >= n_min or sizes[0] == before[0] + 1
        again = ctl.step(view(*(worker(w.worker_id, pool=pools[w.worker_id], queued=w.load.queued_prefill_tokens,
                                       busy=w.load.busy_fraction) for w in workers)), NOW + 1.0)
        assert again.move is None or sizes[0] < n_min  # within the cool-down only a refill moves


def test_percentile_is_nearest_rank():
    assert percentile([], 90) == 0.0
    assert percentile([3.0], 90) == 3.0
    assert percentile(list(map(float, range(1, 11))), 90) == 9.0


# ---- in the simulator ---------------------------------------------------------------------------
def test_the_simulator_runs_the_controller_every_period_within_its_bounds():
    sim = Simulator.from_preset(5, "H100", "Llama-3-8B", roles=pd_roles(5, 4), placement_policy="laps",
                                batch_policy="laps", slo_ttft_ms=400)
    lengths = [64, 64, 64, 6000]
    items = [SimRequestSpec(f"r{i}", lengths[i % 4], 8) for i in range(400)]
    outcome = sim.run(items, list(np.arange(400) / 20.0))
    assert all(r.ok for r in outcome.results)
    timeline = outcome.stats.pool_timeline
    assert timeline[0][3:] == [2, 2]  # the controller split the four unpooled instances at once
    assert all(row[3] >= 1 and row[4] >= 1 and row[3] + row[4] == 4 for row in timeline)
    assert outcome.stats.pool_moves == sum(1 for a, b in zip(timeline, timeline[1:]) if a[3] != b[3])


def test_a_pool_below_n_min_is_refilled_at_once_whatever_the_pressures_and_cool_down():
    ctl = controller()
    ctl.last_move_at = NOW  # just moved: the cool-down holds pressure moves, not this
    cluster = view(worker("p0", pool="long", queued=50_000, busy=1.0), worker("p1", pool="long"),
                   worker("p2", pool="long", busy=0.5))
    assert ctl.step(cluster, NOW + 1).move == PoolMove("p1", "long", "short")


def test_pd_baseline_can_route_prefills_round_robin_as_vanilla_data_parallel_dispatch():
    policy = make_policy("pd_disaggregated", prefill_routing="round_robin")
    cluster = view(worker("p0", queued=90_000), worker("p1"), worker("p2"), worker("d0", "decode"))
    assert [policy.place(request(50), cluster, NOW).worker_ids[0] for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    with pytest.raises(ValueError, match="prefill_routing"):
        make_policy("pd_disaggregated", prefill_routing="random")


def test_the_boundary_refits_online_from_measured_single_prefill_steps():
    boundary = LengthBoundary(TOY, learning_rate=0.5)
    # The device reads memory twice as slowly as the model says: memory-bound steps measure
    # 2x their memory term, so the ridge (L_m) moves up to where compute reaches 4 ms.
    for _ in range(40):
        boundary.observe(50, 0, 2 * TOY.prefill_terms(0, 50)[1])
    assert boundary.memory_scale == pytest.approx(2.0, rel=1e-3) and boundary.compute_scale == 1.0
    assert boundary.tokens(0) == pytest.approx(400.0, rel=1e-3)
    # Compute-bound steps measured as predicted leave the compute scale where it is.
    boundary.observe(4000, 0, TOY.prefill_terms(0, 4000)[0])
    assert boundary.compute_scale == pytest.approx(1.0)
    # Only a step that ran one prefill alone counts; a fixed boundary never moves.
    before = boundary.num_observed
    boundary.observe_step(((0, 50), (0, 60)), 0, 1.0)
    boundary.observe_step(((0, 50),), 3, 1.0)
    assert boundary.num_observed == before
    fixed = LengthBoundary(TOY, 64)
    fixed.observe(50, 0, 1.0)
    assert fixed.tokens(0) == 64 and fixed.num_observed == 0


def test_with_measured_tables_the_refit_scales_their_boundary_and_steps_as_measured_leave_it():
    pytest.importorskip("aiconfigurator_core")
    from splitserve.perf.backends import perf_model_for

    model = perf_model_for("a100_sxm", "qwen2.5-14b", 1, backend="aiconfigurator")
    assert model.tables is not None
    boundary = LengthBoundary(model, learning_rate=0.5)
    lm = model.prefill_boundary(0)
    # The simulator's steps are the tables' own: the boundary stays the tables' L_m.
    for n in (16, 64, 4096, 8192):
        boundary.observe(n, 0, model.prefill_time(0, n))
    assert boundary.tokens(0) == pytest.approx(lm) and boundary.num_observed == 4
    # Short prefills measured 2x slower (memory slower than measured there): L_m doubles.
    for _ in range(40):
        boundary.observe(16, 0, 2 * model.prefill_time(0, 16))
    assert boundary.memory_scale == pytest.approx(2.0, rel=1e-3) and boundary.compute_scale == pytest.approx(1.0)
    assert boundary.tokens(0) == pytest.approx(2 * lm, rel=1e-3)


def test_the_performance_model_may_be_named_as_a_preset_as_splitserve_up_names_it():
    policy = make_policy("laps", perf_model="A100/qwen2.5-14b/1")
    assert policy.boundary.tokens(0) == pytest.approx(policy.perf_model.prefill_boundary(0))
    with pytest.raises(ValueError, match="perf model"):
        make_policy("laps", perf_model="not-a-preset")


def test_the_boundary_follows_what_the_prefill_workers_refit_unless_it_is_fixed():
    # The workers measured a slower memory than the model says: their L_m(0) is 400, not 200.
    cluster = view(worker("p0", pool="short", l_m=400.0), worker("p1", pool="long", l_m=380.0),
                   worker("p2", pool="long", l_m=420.0), worker("d0", "decode"))
    followed = LapsPlacementPolicy(perf_model=TOY).place(request(300), cluster, NOW)
    assert followed.decision["short"] == 1.0 and followed.decision["l_m"] == pytest.approx(400.0)
    own = LapsPlacementPolicy(perf_model=TOY, follow_workers=False).place(request(300), cluster, NOW)
    assert own.decision["short"] == 0.0
    fixed = LapsPlacementPolicy(perf_model=TOY, boundary_tokens=250).place(request(300), cluster, NOW)
    assert fixed.decision["l_m"] == 250 and fixed.decision["short"] == 0.0
    silent = view(worker("p0", pool="short"), worker("p1", pool="long"), worker("d0", "decode"))
    assert LapsPlacementPolicy(perf_model=TOY).place(request(300), silent, NOW).decision["l_m"] == \
        pytest.approx(200.0)
