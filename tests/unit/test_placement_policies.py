"""Placement policies and the cluster-view bookkeeping over hand-made views (pure)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.global_scheduler import policy as policy_module
from services.global_scheduler.baselines import LeastLoadedPolicy, RoundRobinPolicy
from services.global_scheduler.policy import (
    ClusterView,
    CompletionListener,
    NoWorkerAvailable,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    StagePlacement,
    WorkerView,
    known_policies,
    make_policy,
    register_policy,
)
from services.global_scheduler.cluster_view import InflightCounters, build_cluster_view
from splitserve.errors import Unavailable
from splitserve.state.store import WorkerInfo, WorkerLoad

NOW = 1_700_000_000.0


def worker(worker_id: str, role: str = "both", *, free: int = 100, total: int = 100, running: int = 0,
           waiting: int = 0, queued: int = 0, draining: bool = False, inflight: int = 0) -> WorkerView:
    load = WorkerLoad(worker_id, role=role, engine_kind="emulated", free_blocks=free, total_blocks=total,
                      block_size=16, running=running, waiting=waiting, queued_prefill_tokens=queued,
                      draining=draining)
    return WorkerView(worker_id=worker_id, address=f"{worker_id}:1", load=load, inflight_assigned=inflight)


def cluster(*workers: WorkerView) -> ClusterView:
    return ClusterView(tuple(workers), NOW)


def request(prompt_len: int = 10, max_tokens: int = 5, request_id: str = "r") -> PlacementRequest:
    return PlacementRequest(request_id=request_id, prompt_len=prompt_len, max_tokens=max_tokens)


def chosen(policy: PlacementPolicy, view: ClusterView, req: PlacementRequest | None = None) -> str:
    placement = policy.place(req or request(), view, NOW)
    assert len(placement.stages) == 1
    return placement.stages[0].worker_id


# ---- registry and data -------------------------------------------------------------


def test_registry_builds_baselines_and_names_unknown_policies():
    assert {"round_robin", "least_loaded"} <= set(known_policies())
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    ll = make_policy("least_loaded", request_scale="4")  # SetPolicy passes strings
    assert isinstance(ll, LeastLoadedPolicy) and ll.request_scale == 4.0
    with pytest.raises(ValueError, match="unknown placement policy 'nope'.*least_loaded.*round_robin"):
        make_policy("nope")
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("round_robin", speed=3)
    with pytest.raises(ValueError, match="request_scale"):
        make_policy("least_loaded", request_scale="0")


def test_registered_policy_is_built_by_name(monkeypatch):
    monkeypatch.setattr(policy_module, "_REGISTERED", {})  # keep the registry clean for other tests

    class Fixed:
        name = "fixed_for_test"

        def place(self, req, view, now):
            return Placement.single_stage(view.workers[0], req, self.name)

    register_policy("fixed_for_test", Fixed)
    assert "fixed_for_test" in known_policies()
    built = make_policy("fixed_for_test")
    assert isinstance(built, PlacementPolicy) and not isinstance(built, CompletionListener)
    # Baselines take no feedback, so the coordinator never sends them completion reports.
    assert not isinstance(RoundRobinPolicy(), CompletionListener)
    assert not isinstance(LeastLoadedPolicy(), CompletionListener)


def test_cluster_view_sorts_and_filters():
    view = cluster(worker("c", "decode"), worker("a", draining=True), worker("b", "prefill"))
    assert [w.worker_id for w in view.workers] == ["a", "b", "c"]
    assert [w.worker_id for w in view.eligible] == ["b", "c"]
    assert [w.worker_id for w in view.by_role("prefill", "both")] == ["b"]
    assert [w.worker_id for w in view.by_role("both", eligible_only=False)] == ["a"]
    assert view.get("c").role == "decode" and view.get("zz") is None


def test_request_and_placement_invariants():
    with pytest.raises(ValueError, match="prompt_len"):
        request(prompt_len=0)
    with pytest.raises(ValueError, match="history_len"):
        PlacementRequest(request_id="r", prompt_len=4, max_tokens=1, history_len=5)
    with pytest.raises(ValueError, match="at least one stage"):
        Placement((), "p")
    with pytest.raises(ValueError, match="start at 4"):
        Placement((StagePlacement("a", "a:1", 0, 4), StagePlacement("b", "b:1", 5, 9)), "p")
    split = Placement((StagePlacement("a", "a:1", 0, 4), StagePlacement("b", "b:1", 4, 9)), "p")
    assert split.end == 9 and split.worker_ids == ("a", "b")


def test_no_worker_available_is_unavailable():
    assert issubclass(NoWorkerAvailable, Unavailable)
    for policy in (RoundRobinPolicy(), LeastLoadedPolicy()):
        with pytest.raises(NoWorkerAvailable):
            policy.place(request(), cluster(), NOW)
        with pytest.raises(NoWorkerAvailable):
            policy.place(request(), cluster(worker("a", draining=True)), NOW)


# ---- round robin -------------------------------------------------------------------


def test_round_robin_cycles_in_worker_id_order():
    policy = RoundRobinPolicy()
    view = cluster(worker("w2"), worker("w0"), worker("w1"))
    assert [chosen(policy, view) for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_round_robin_skips_draining_and_non_colocated_workers():
    policy = RoundRobinPolicy()
    view = cluster(worker("a"), worker("b", draining=True), worker("c"), worker("d", "prefill"))
    assert [chosen(policy, view) for _ in range(4)] == ["a", "c", "a", "c"]


def test_round_robin_uses_any_role_when_no_colocated_worker_exists():
    policy = RoundRobinPolicy()
    view = cluster(worker("p", "prefill"), worker("d", "decode"))
    assert [chosen(policy, view) for _ in range(3)] == ["d", "p", "d"]


def test_round_robin_continues_after_membership_changes():
    policy = RoundRobinPolicy()
    assert chosen(policy, cluster(worker("a"), worker("b"), worker("c"))) == "a"
    assert chosen(policy, cluster(worker("a"), worker("b"), worker("c"))) == "b"
    # b left: the turn passes to the next id after b, not back to a.
    assert chosen(policy, cluster(worker("a"), worker("c"))) == "c"
    assert chosen(policy, cluster(worker("a"), worker("c"))) == "a"


# ---- least loaded ------------------------------------------------------------------


@pytest.mark.parametrize(
    "busy_fields",
    [dict(free=10), dict(queued=4096), dict(running=8), dict(waiting=8), dict(inflight=8)],
)
def test_least_loaded_avoids_the_busier_worker(busy_fields):
    policy = LeastLoadedPolicy()
    assert chosen(policy, cluster(worker("a", **busy_fields), worker("b"))) == "b"
    assert chosen(policy, cluster(worker("a"), worker("b", **busy_fields))) == "a"


def test_least_loaded_score_formula_and_ties():
    policy = LeastLoadedPolicy(prefill_token_scale=1000, request_scale=10)
    w = worker("a", free=25, total=100, queued=500, running=2, waiting=1, inflight=2)
    assert policy.score(w) == pytest.approx(0.75 + 0.5 + 0.5)
    assert policy.score(worker("nokv", free=0, total=0)) == pytest.approx(1.0)
    assert chosen(policy, cluster(worker("b"), worker("a"))) == "a"  # tie: smallest id


def test_least_loaded_spreads_a_burst_with_inflight_counters():
    """Placements within one refresh interval spread once counted as inflight."""
    policy = LeastLoadedPolicy()
    infos = [WorkerInfo("a", "a:1"), WorkerInfo("b", "b:1"), WorkerInfo("c", "c:1")]
    loads = {i.worker_id: WorkerLoad(i.worker_id, free_blocks=100, total_blocks=100,
                                             updated_unix=NOW) for i in infos}
    counters = InflightCounters()
    counters.observe_snapshots(loads)
    picks = []
    for n in range(6):
        view = build_cluster_view(infos, loads, NOW, counters.counts())
        placement = policy.place(request(request_id=f"r{n}"), view, NOW)
        counters.note_placed(placement.worker_ids)
        picks.append(placement.worker_ids[0])
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert counters.counts() == {"a": 2, "b": 2, "c": 2}


# ---- cluster view bookkeeping ------------------------------------------------------


def test_inflight_counters_reset_only_for_workers_with_a_new_snapshot():
    counters = InflightCounters()
    loads = {w: WorkerLoad(w, updated_unix=NOW) for w in ("a", "b")}
    counters.observe_snapshots(loads)
    counters.note_placed(["a", "a", "b"])
    counters.observe_snapshots(loads)  # same snapshots again: nothing new is reflected
    assert counters.counts() == {"a": 2, "b": 1}
    counters.observe_snapshots({**loads, "a": WorkerLoad("a", updated_unix=NOW + 1)})
    assert counters.counts() == {"b": 1}
    counters.observe_snapshots({"a": WorkerLoad("a", updated_unix=NOW + 1)})  # b vanished
    counters.note_placed(["a"])
    assert counters.counts() == {"a": 1}


def test_build_cluster_view_joins_registry_and_loads():
    infos = [WorkerInfo("a", "h:1", role="both", engine_kind="llama"), WorkerInfo("b", "h:2"),
             WorkerInfo("c", "h:3")]
    loads = {
        "a": WorkerLoad("a", role="prefill", free_blocks=3, total_blocks=8, block_size=16,
                                running=1, waiting=2, queued_prefill_tokens=40, draining=True),
        "b": WorkerLoad("b", role="", engine_kind="emulated"),
        "zombie": WorkerLoad("zombie"),  # load without a registration: not a worker
    }
    view = build_cluster_view(infos, loads, NOW, {"b": 3})
    assert [w.worker_id for w in view.workers] == ["a", "b"]  # c has no load snapshot
    a, b = view.workers
    assert a == WorkerView("a", "h:1", dataclasses.replace(loads["a"], engine_kind="llama"), 0)
    assert (b.role, b.engine_kind, b.inflight_assigned) == ("both", "emulated", 3)
    assert view.taken_at == NOW


# ---- properties --------------------------------------------------------------------

worker_views = st.builds(
    lambda idx, role, total, free_frac, running, waiting, queued, draining, inflight: worker(
        f"w{idx:02d}", role, free=int(total * free_frac), total=total, running=running, waiting=waiting,
        queued=queued, draining=draining, inflight=inflight),
    idx=st.integers(0, 30),
    role=st.sampled_from(["both", "prefill", "decode"]),
    total=st.integers(0, 4096),
    free_frac=st.floats(0, 1),
    running=st.integers(0, 256),
    waiting=st.integers(0, 256),
    queued=st.integers(0, 100_000),
    draining=st.booleans(),
    inflight=st.integers(0, 64),
)
clusters = st.lists(worker_views, max_size=8, unique_by=lambda w: w.worker_id).map(
    lambda ws: ClusterView(tuple(ws), NOW))
requests = st.builds(request, prompt_len=st.integers(1, 100_000), max_tokens=st.integers(0, 8192))


@settings(max_examples=300, deadline=None)
@given(view=clusters, reqs=st.lists(requests, min_size=1, max_size=5),
       policy_name=st.sampled_from(["round_robin", "least_loaded"]))
def test_placement_picks_an_eligible_worker_and_covers_the_sequence(view, reqs, policy_name):
    policy = make_policy(policy_name)
    for req in reqs:
        if not view.eligible:
            with pytest.raises(NoWorkerAvailable):
                policy.place(req, view, NOW)
            continue
        placement = policy.place(req, view, NOW)
        assert placement.policy == policy_name
        assert placement.stages[0].start == 0 and placement.end == req.prompt_len + req.max_tokens
        for stage in placement.stages:
            picked = view.get(stage.worker_id)
            assert picked is not None and picked.eligible and stage.address == picked.address
            if view.by_role("both"):  # colocated baselines stay on colocated workers when any exist
                assert picked.role == "both"


@settings(max_examples=200, deadline=None)
@given(view=clusters)
def test_least_loaded_choice_has_the_minimum_score(view):
    policy = LeastLoadedPolicy()
    candidates = view.by_role("both") or view.eligible
    if not candidates:
        return
    picked = view.get(chosen(policy, view))
    assert policy.score(picked) == min(policy.score(w) for w in candidates)


@settings(max_examples=100, deadline=None)
@given(view=clusters)
def test_round_robin_visits_every_candidate_once_per_cycle(view):
    policy = RoundRobinPolicy()
    candidates = view.by_role("both") or view.eligible
    if not candidates:
        return
    picks = [chosen(policy, view) for _ in range(2 * len(candidates))]
    expected = [w.worker_id for w in candidates]
    assert picks == expected * 2


def test_worker_view_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        worker("a").inflight_assigned = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        worker("a").load.free_blocks = 3  # type: ignore[misc]
