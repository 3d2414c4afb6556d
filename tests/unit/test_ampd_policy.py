"""AMPD's placement (binding + Alg. 1 routing with the Eq. 1-2 costs) over hand-made views,
and the simulator running it: sessions keep their history on the bound worker, remote
incremental prefills pull it and push back only the new KV."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen import arrivals
from loadgen.sessions import Round, Session
from services.global_scheduler.ampd import (RULE_COST, RULE_FIXED, RULE_ITL_SLACK, RULE_NO_CHOICE, RULE_TTFT_SLACK,
                                            AmpdPolicy, runs_locally)
from services.global_scheduler.policy import (ClusterView, NoWorkerAvailable, PlacementRequest, WorkerSignals,
                                              WorkerView, make_policy, orient_kv_transfers)
from services.planner.sim_run import SimRun
from services.planner.sim_worker import WindowedMean
from services.planner.simulator import NetworkLatency, Simulator
from splitserve.perf.model import DecodeCoeffs, PerfModel, PrefillCoeffs, TransferCoeffs
from splitserve.core.records import PrefillTask, WorkerLoad

NOW = 1_700_000_000.0
# 1 ms + 10 us per prefill token; KV moves at 1 us per token after 100 us.
TOY = PerfModel(PrefillCoeffs(c0=1e-3, c_tok=1e-5), DecodeCoeffs(c0=2e-3, c_seq=1e-4, c_ctx=1e-7),
                TransferCoeffs(latency=1e-4, per_token=1e-6), kv_bytes_per_token=1024)


def worker(worker_id: str, role: str, *, free: int = 100, ttft: float | None = None, itl: float | None = None,
           queue: tuple[int, ...] = (), draining: bool = False) -> WorkerView:
    load = WorkerLoad(worker_id, role=role, engine_kind="simulated", free_blocks=free, total_blocks=100,
                      block_size=16, draining=draining, updated_unix=NOW)
    tasks = tuple(PrefillTask(f"{worker_id}/t{i}", 0, n, NOW) for i, n in enumerate(queue))
    return WorkerView(worker_id, f"{worker_id}:1", load, signals=WorkerSignals(ttft, itl, tasks))


def request(prompt_len: int = 1000, history: int = 0, bound: str = "", max_tokens: int = 50,
            ttft_ms: int = 350, itl_ms: int = 40) -> PlacementRequest:
    return PlacementRequest("r", prompt_len, max_tokens, session_id="s" if history or bound else "",
                            history_len=history, bound_worker=bound, slo_ttft_ms=ttft_ms, slo_itl_ms=itl_ms)


def policy(**params) -> AmpdPolicy:
    return AmpdPolicy(perf_model=TOY, **params)


def place(p: AmpdPolicy, view_workers: list[WorkerView], req: PlacementRequest):
    view = ClusterView(tuple(view_workers), NOW)
    return orient_kv_transfers(p.place(req, view, NOW), view)


def test_registered_and_parameters_are_checked_by_name():
    assert isinstance(make_policy("ampd", deployment_perf_model=TOY), AmpdPolicy)
    for bad, field in ((dict(alpha=0), "alpha"), (dict(beta=1.5), "beta"), (dict(ttft_slo_ms=-1), "ttft_slo_ms"),
                       (dict(routing="sometimes"), "routing"), (dict(itl_slo_ms="x"), "itl_slo_ms"),
                       (dict(routing="share", local_share=1.5), "local_share"),
                       (dict(routing="adaptive", local_share=0.5), "local_share"),
                       (dict(slack_choice="first"), "slack_choice")):
        with pytest.raises(ValueError, match=field):
            policy(**bad)


def test_a_new_session_binds_to_the_decode_worker_with_most_free_kv():
    workers = [worker("p0", "prefill"), worker("d0", "decode", free=40), worker("d1", "decode", free=90),
               worker("d2", "decode", free=90)]
    placement = place(policy(), workers, request())
    assert placement.worker_ids == ("p0", "d1")  # d1 and d2 tie on memory: the smaller id


def test_rule_1_a_prefill_worker_with_ttft_slack_runs_it_remotely():
    workers = [worker("p0", "prefill", ttft=0.34), worker("p1", "prefill", ttft=0.1), worker("d0", "decode")]
    placement = place(policy(), workers, request(prompt_len=1000, history=600, bound="d0"))
    # p0's windowed TTFT 340 ms > 0.9 x 350 ms: only p1 has slack.
    assert placement.worker_ids == ("p1", "d0")
    assert [(s.start, s.end) for s in placement.stages] == [(0, 1000), (1000, 1050)]
    assert placement.stages[0].push_kv
    assert placement.decision["rule"] == RULE_TTFT_SLACK and placement.decision["remote"] == 1.0
    # Eq. 2: T_pre(600, 400) + T_kv(600) + T_kv(400), nothing queued.
    expected = TOY.prefill_time(600, 400) + TOY.kv_transfer_time(600) + TOY.kv_transfer_time(400)
    assert placement.decision["t_remote_s"] == pytest.approx(expected)


def test_among_workers_with_slack_the_cheapest_takes_it_or_a_random_one_as_the_paper():
    # Both have TTFT slack; p1 has a prefill queued, so its Eq. 2 cost is higher.
    workers = [worker("p0", "prefill", ttft=0.1), worker("p1", "prefill", ttft=0.1, queue=(3000,)),
               worker("d0", "decode")]
    for seed in range(8):
        placement = place(policy(seed=seed), workers, request(history=600, bound="d0"))
        assert placement.worker_ids == ("p0", "d0") and placement.decision["rule"] == RULE_TTFT_SLACK
    chosen = {place(policy(seed=seed, slack_choice="random"), workers, request(history=600, bound="d0")).worker_ids[0]
              for seed in range(8)}
    assert chosen == {"p0", "p1"}  # the paper's line 1: any worker with slack, in random order
    # A cheaper worker without slack is still passed over.
    workers = [worker("p0", "prefill", ttft=0.34), worker("p1", "prefill", ttft=0.1, queue=(3000,)),
               worker("d0", "decode")]
    assert place(policy(), workers, request(history=600, bound="d0")).worker_ids == ("p1", "d0")


def test_rule_2_no_prefill_slack_but_decode_itl_slack_runs_it_locally():
    workers = [worker("p0", "prefill", ttft=0.5), worker("d0", "decode", itl=0.030)]
    placement = place(policy(), workers, request(history=600, bound="d0"))
    assert placement.worker_ids == ("d0",) and placement.stages[0].end == 1050
    assert placement.decision["rule"] == RULE_ITL_SLACK and placement.decision["remote"] == 0.0
    # 0.85 x 40 ms = 34 ms: an ITL of 35 ms has no slack left, so the costs decide.
    placement = place(policy(), [worker("p0", "prefill", ttft=0.5), worker("d0", "decode", itl=0.035)],
                      request(history=600, bound="d0"))
    assert placement.decision["rule"] == RULE_COST


def test_rule_3_the_cheaper_of_local_and_remote_by_eq_1_and_2():
    busy_prefill = worker("p0", "prefill", ttft=0.5, queue=(4000, 4000))
    busy_decode = worker("d0", "decode", itl=0.05)
    placement = place(policy(), [busy_prefill, busy_decode], request(history=600, bound="d0"))
    assert placement.worker_ids == ("d0",) and placement.decision["rule"] == RULE_COST
    assert placement.decision["t_local_s"] == pytest.approx(TOY.prefill_time(600, 400))
    # Now the decode worker has the longer queue: remote wins.
    placement = place(policy(), [worker("p0", "prefill", ttft=0.5), worker("d0", "decode", itl=0.05, queue=(8000,))],
                      request(history=600, bound="d0"))
    assert placement.worker_ids == ("p0", "d0") and placement.decision["rule"] == RULE_COST
    assert placement.decision["t_local_s"] == pytest.approx(TOY.prefill_time(600, 400) + TOY.prefill_time(0, 8000))


def test_a_burst_inside_one_snapshot_stops_at_the_slo_instead_of_piling_on_one_worker():
    # The window shows no TTFT yet (idle), but each placement adds its prefill to what the
    # policy knows is queued there: once the predicted cost passes the SLO, rule 1 refuses.
    p = policy()
    workers = [worker("p0", "prefill"), worker("d0", "decode", itl=0.01)]
    routes = [place(p, workers, request(prompt_len=4000)).decision["rule"] for _ in range(12)]
    per_prefill = TOY.prefill_time(0, 4000)  # 41 ms
    remote_first = int(0.350 // per_prefill)
    assert routes[:remote_first] == [RULE_TTFT_SLACK] * remote_first
    assert RULE_ITL_SLACK in routes[remote_first:]
    # A new snapshot (updated_unix moves) replaces what was placed by the published queue.
    fresh = [WorkerView(w.worker_id, w.address, WorkerLoad(**{**w.load.__dict__, "updated_unix": NOW + 1}),
                        signals=w.signals) for w in workers]
    assert place(p, fresh, request(prompt_len=4000)).decision["rule"] == RULE_TTFT_SLACK


def test_the_bound_worker_keeps_the_session_and_a_lost_one_rebinds_with_the_history_recomputed():
    workers = [worker("p0", "prefill", ttft=0.5), worker("d0", "decode", free=10, itl=0.01),
               worker("d1", "decode", free=90)]
    assert place(policy(), workers, request(history=600, bound="d0")).worker_ids == ("d0",)
    workers[1] = worker("d0", "decode", draining=True)
    placement = place(policy(), workers, request(history=600, bound="d0"))
    assert placement.worker_ids[-1] == "d1"
    assert placement.decision["rebound"] == 1.0 and placement.decision["history_len"] == 0.0
    assert "re-bound from d0" in placement.reason


def test_ablations_and_the_no_choice_cases():
    workers = [worker("p0", "prefill", ttft=0.5), worker("d0", "decode", itl=0.01)]
    assert place(policy(routing="remote"), workers, request()).worker_ids == ("p0", "d0")
    placement = place(policy(routing="local"), [worker("p0", "prefill"), worker("d0", "decode")], request())
    assert placement.worker_ids == ("d0",) and placement.decision["rule"] == RULE_FIXED
    # routing="share": the rounds whose id hashes below the share run locally, the rest remote.
    ids = [f"s/r{i}" for i in range(40)]
    local = [place(policy(routing="share", local_share=0.5), workers,
                   dataclasses.replace(request(), request_id=i)).worker_ids == ("d0",) for i in ids]
    assert local == [runs_locally(i, 0.5) for i in ids] and 10 < sum(local) < 30
    assert all(place(policy(routing="share", local_share=share), workers,
                     dataclasses.replace(request(), request_id=i)).worker_ids == expected
               for i in ids for share, expected in ((0.0, ("p0", "d0")), (1.0, ("d0",))))
    only_decode = place(policy(), [worker("d0", "decode")], request())
    assert only_decode.worker_ids == ("d0",) and only_decode.decision["rule"] == RULE_NO_CHOICE
    colocated = place(policy(), [worker("b0", "both"), worker("b1", "both", free=99)], request())
    assert colocated.worker_ids == ("b0",)
    with pytest.raises(NoWorkerAvailable):
        place(policy(), [worker("d0", "decode", draining=True)], request())


def test_without_any_slo_the_costs_decide():
    workers = [worker("p0", "prefill", queue=(3000,)), worker("d0", "decode")]
    placement = place(policy(), workers, request(ttft_ms=0, itl_ms=0))
    assert placement.decision["rule"] == RULE_COST and placement.worker_ids == ("d0",)


@settings(max_examples=150, deadline=None)
@given(roles=st.lists(st.sampled_from(["prefill", "decode", "both"]), min_size=1, max_size=5),
       ttfts=st.lists(st.one_of(st.none(), st.floats(0, 2)), min_size=5, max_size=5),
       itls=st.lists(st.one_of(st.none(), st.floats(0, 0.2)), min_size=5, max_size=5),
       queues=st.lists(st.lists(st.integers(1, 8000), max_size=3), min_size=5, max_size=5),
       prompt=st.integers(2, 5000), history_share=st.floats(0, 1), bound=st.integers(-1, 4),
       max_tokens=st.integers(0, 300), routing=st.sampled_from(["adaptive", "remote", "local"]))
def test_every_plan_is_valid_and_prefills_only_ever_move_to_a_prefill_worker(
        roles, ttfts, itls, queues, prompt, history_share, bound, max_tokens, routing):
    workers = [worker(f"w{i}", role, ttft=ttfts[i], itl=itls[i], queue=tuple(queues[i])) for i, role in enumerate(roles)]
    bound_id = f"w{bound}" if 0 <= bound < len(roles) else ""
    history = int(history_share * (prompt - 1)) if bound_id else 0
    req = request(prompt_len=prompt, history=history, bound=bound_id, max_tokens=max_tokens)
    eligible_decode = [w for w in workers if w.role == "decode"] or [w for w in workers if w.role == "both"] or workers
    placement = place(policy(routing=routing), workers, req)
    assert placement.end == prompt + max_tokens
    decode_id = placement.worker_ids[-1]
    assert decode_id in {w.worker_id for w in eligible_decode}
    if bound_id in {w.worker_id for w in eligible_decode}:
        assert decode_id == bound_id  # a live bound worker keeps its session
    if len(placement.stages) == 2:
        first = next(w for w in workers if w.worker_id == placement.worker_ids[0])
        assert first.role == "prefill" and placement.stages[0].end == prompt and placement.stages[0].push_kv


# ---- the simulator runs it -----------------------------------------------------------------


def sessions(count: int) -> list[Session]:
    return [Session(f"s{i}", [Round(700, 20, 0.0), Round(300, 20, 0.2), Round(300, 20, 0.2)]) for i in range(count)]


def test_windowed_mean_forgets_samples_older_than_the_window():
    window = WindowedMean(10.0)
    assert window.mean(0.0) is None
    window.add(0.5, 1.0)
    window.add(5.0, 3.0, count=3)
    assert window.mean(6.0) == pytest.approx((1.0 + 9.0) / 4)
    assert window.mean(11.5) == pytest.approx(3.0)  # the first second's bucket left the window
    assert window.mean(30.0) is None


@pytest.mark.parametrize("routing,remote", [("remote", True), ("local", False)])
def test_simulated_sessions_keep_history_on_the_bound_worker(routing, remote):
    sim = Simulator(3, TOY, roles=("prefill", "decode", "decode"), placement_policy="ampd",
                    policy_params={"routing": routing}, num_kv_blocks=4000, latency=NetworkLatency(0.0, 0.0, 0.0),
                    slo_ttft_ms=350, slo_itl_ms=40)
    items = sessions(6)
    run = SimRun(sim.config, items, arrivals.poisson(4.0).offsets(len(items), np.random.default_rng(0)))
    results = run.execute()
    assert len(results) == 18 and all(r.ok for r in results), [r.error for r in results if not r.ok]
    decode_workers = run.workers[1:]
    lost = sum(w.scheduler.session_pins.history_lost for w in run.workers)
    hits = sum(w.scheduler.session_pins.history_hits for w in decode_workers)
    assert lost == 0 and hits == 12  # rounds 1 and 2 of every session found their history
    if remote:
        # Every later round read its history (prompt + output of the rounds before, less the last
        # sampled token: 719 and 1,039 tokens) once, in the whole blocks of 16 pinned on the
        # decode worker (704 and 1,024 tokens) ...
        assert run.stats.kv_pulls == 12
        assert run.stats.kv_pulled_tokens + run.stats.history_cached_tokens == 6 * (704 + 1024)
        # ... of which the prefill worker had computed the earlier prompts itself (688 and 1,008
        # tokens in whole blocks): only the block with the end of the last output came over.
        assert run.stats.kv_pulled_tokens == 6 * (16 + 16)
    else:
        assert run.stats.kv_pulls == 0 and run.stats.kv_transfers == 0
    for w in run.workers:  # sessions closed: every pin released, every block back
        assert len(w.scheduler.session_pins) == 0
        assert w.block_manager.num_free_blocks == w.block_manager.num_blocks


def test_workers_a_request_failed_on_are_left_out_of_its_view():
    """The coordinator names the workers an attempt failed on (`avoid_workers`); the view the
    policy sees leaves them out, so a bound decode worker that just died (still registered
    until its heartbeat expires) is re-bound at once instead of being tried again."""
    from services.global_scheduler.server import placement_request_from_meta
    from splitserve.proto import types_pb2

    meta = types_pb2.RequestMeta(request_id="r", session_id="s", prompt_len=1000, history_len=600, max_tokens=50,
                                 bound_worker="d0", avoid_workers=["d0", "p0"])
    req = placement_request_from_meta(meta)
    assert req.avoid_workers == ("d0", "p0")
    workers = [worker("p0", "prefill", ttft=0.01), worker("d0", "decode", itl=0.01), worker("d1", "decode")]
    view = ClusterView(tuple(workers), NOW)
    assert view.without(()) is view
    narrowed = view.without(req.avoid_workers)
    assert [w.worker_id for w in narrowed.workers] == ["d1"] and narrowed.taken_at == NOW
    placement = orient_kv_transfers(policy().place(req, narrowed, NOW), narrowed)
    assert placement.worker_ids == ("d1",)  # re-bound, and the prefill runs locally: p0 failed too
    assert placement.decision["rebound"] == 1.0 and placement.decision["history_len"] == 0.0
