"""Discrete-event simulator: hand-checked timings, real policies, stages, accounting, fast-forward."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from loadgen import arrivals
from loadgen.metrics import Slo, summarize
from loadgen.report import compare
from loadgen.runner import CUT_OFF
from loadgen.sessions import Round, Session
from services.global_scheduler import policy as policy_module
from services.global_scheduler.baselines import LeastLoadedPolicy, RoundRobinPolicy
from services.global_scheduler.policy import ClusterView, PlacementRequest
from services.planner import sim_run, sim_worker
from services.planner.cli import simulate_app
from services.planner.sim_run import SimRun
from services.planner.sim_workload import SimRequestSpec
from services.planner.simulator import NetworkLatency, Simulator, pd_roles
from splitserve.perf.model import DecodeCoeffs, PerfModel, PrefillCoeffs, TransferCoeffs
from splitserve.core import BlockManager, FcfsPolicy, Scheduler, StageKey, build_batch_policy

# Round numbers, compute-bound everywhere (memory lines are 0): easy to check by hand.
TOY = PerfModel(PrefillCoeffs(c0=1e-3, c_tok=1e-5), DecodeCoeffs(c0=2e-3, c_seq=1e-4, c_ctx=1e-7),
                TransferCoeffs(latency=1e-4, per_token=1e-6), label="toy")
NO_DELAY = NetworkLatency(0.0, 0.0, 0.0)


def toy_sim(num_workers: int = 1, **options) -> Simulator:
    options.setdefault("num_kv_blocks", 2000)
    options.setdefault("latency", NO_DELAY)
    return Simulator(num_workers, TOY, **options)


def spec(i: int, prompt_len: int, output_len: int) -> SimRequestSpec:
    return SimRequestSpec(f"req-{i}", prompt_len, output_len)


def t_xfer(tokens: int) -> float:
    return TOY.kv_transfer_time(tokens)


def test_one_request_on_one_worker_matches_the_perf_model_by_hand():
    latency = NetworkLatency(dispatch_s=1e-3, handoff_s=5e-4, stream_s=2e-4)
    result = toy_sim(latency=latency).run([spec(0, 100, 5)]).results[0]
    assert result.ok and result.output_len == 5 and result.prompt_len == 100
    # One prefill step of 100 tokens: 1 ms + 100 * 10 us = 2 ms, after 1 ms dispatch and 0.2 ms stream.
    assert result.ttft_s == pytest.approx(1e-3 + 2e-3 + 2e-4, rel=1e-12)
    assert TOY.prefill_time(0, 100) == pytest.approx(2e-3)
    # Decode i reads the KV of prompt + i tokens.
    expected_itls = [TOY.decode_time(1, 100 + i) for i in range(1, 5)]
    assert result.itls_s.tolist() == pytest.approx(expected_itls, rel=1e-12)
    assert result.end_s == pytest.approx(result.first_token_s + sum(expected_itls), rel=1e-12)


def test_pd_stage_adds_the_kv_transfer_of_its_chunks():
    colocated = toy_sim().run([spec(0, 100, 5)]).results[0]
    pd = toy_sim(2, placement_policy="pd_disaggregated", roles=pd_roles(2, 1),
                 latency=NetworkLatency(0.0, handoff_s=3e-4, stream_s=0.0)).run([spec(0, 100, 5)])
    result = pd.results[0]
    assert result.ok and result.output_len == 5 and pd.stats.kv_transfers == 1
    # 100 tokens of KV in 64-token chunks: one whole chunk and the 36-token rest, back to back;
    # the first token is delivered when the push is done (the worker yields it after finish_push).
    assert result.ttft_s == pytest.approx(colocated.ttft_s + t_xfer(64) + t_xfer(36), rel=1e-12)
    # The decode stage starts after the handoff and reads prompt + first token.
    assert result.itls_s[0] == pytest.approx(3e-4 + TOY.decode_time(1, 101), rel=1e-12)
    assert result.itls_s[1:].tolist() == pytest.approx(colocated.itls_s[1:].tolist(), rel=1e-12)


def test_chunked_push_overlaps_all_but_the_last_step_of_a_long_prefill():
    pd = toy_sim(2, placement_policy="pd_disaggregated", roles=pd_roles(2, 1), max_num_batched_tokens=2048)
    result = pd.run([spec(0, 4096, 2)]).results[0]
    first_step = TOY.step_time([(0, 2048)])
    second_step = TOY.step_time([(2048, 2048)])
    # The first step's 32 chunks are pushed while the second step computes; the second step's
    # 32 chunks (the last one at the stage's end) follow it on the critical path.
    assert 32 * t_xfer(64) < second_step
    assert result.ttft_s == pytest.approx(first_step + second_step + 32 * t_xfer(64), rel=1e-12)


def test_a_blocking_kv_receive_holds_up_the_decode_batch_it_joins():
    """vLLM v0's connector (kv_receive="blocking"): the decode worker pulls a prompt's whole KV
    inside the step that first schedules it, so the request already decoding there waits that
    long for its token; the first token comes at the prefill's end, not after a push."""
    items = [spec(0, 100, 40), spec(1, 1000, 5)]  # request 1's prefill ends while request 0 decodes

    def run(mode: str):
        return toy_sim(2, placement_policy="pd_disaggregated", roles=pd_roles(2, 1), kv_receive=mode).run(
            items, [0.0, 0.01])

    pushed, pulled = run("async"), run("blocking")
    for outcome in (pushed, pulled):
        assert all(r.ok for r in outcome.results)
        assert outcome.stats.kv_transfers == 2 and outcome.stats.kv_recomputes == 0
    # Async: the 1,000-token prefill's 16 chunks follow its one step on the link; blocking: none.
    assert pulled.results[1].ttft_s == pytest.approx(pushed.results[1].ttft_s - 15 * t_xfer(64) - t_xfer(40),
                                                     rel=1e-9)
    # Request 0's longest gap is the step request 1 joins: blocking adds the pull of its 1,000
    # tokens to it (the two runs' decode steps differ only by a few tokens of context).
    assert max(pulled.results[0].itls_s) == pytest.approx(max(pushed.results[0].itls_s) + t_xfer(1000), abs=1e-5)
    assert max(pushed.results[0].itls_s) < t_xfer(1000) + TOY.decode_time(1, 100)


def test_kv_receive_names_its_modes():
    with pytest.raises(ValueError, match="kv_receive must be one of async, blocking"):
        toy_sim(2, kv_receive="eager")


def test_split_plan_runs_both_stages_and_recomputes_nothing():
    sim = toy_sim(2, placement_policy="split", policy_params={"split_ratio": "0.5"})
    outcome = sim.run([spec(0, 1000, 10)])
    result = outcome.results[0]
    assert result.ok and result.output_len == 10
    assert outcome.stats.kv_transfers == 1 and outcome.stats.kv_recomputes == 0
    # s = ceil(0.5 * 1010) = 505: alpha prefills [0, 505), beta prefills the rest and samples.
    expected = TOY.prefill_time(0, 505) + t_xfer(64) * 7 + t_xfer(505 - 448) + TOY.prefill_time(505, 495)
    assert result.ttft_s == pytest.approx(expected, rel=1e-12)


def test_the_real_policies_are_called_unchanged(monkeypatch):
    assert sim_run.make_policy is policy_module.make_policy
    assert sim_worker.build_batch_policy is build_batch_policy  # make_batch_policy, plus the perf model
    calls: list[tuple[PlacementRequest, ClusterView, float]] = []
    completions: list[str] = []

    class Recording(RoundRobinPolicy):
        def place(self, request, view, now):
            calls.append((request, view, now))
            return super().place(request, view, now)

        def on_completion(self, report):
            completions.append(report.request_id)

    monkeypatch.setitem(policy_module._REGISTERED, "recording", Recording)
    sim = toy_sim(3, placement_policy="recording", slo_ttft_ms=500, slo_itl_ms=50)
    outcome = sim.run([spec(i, 64, 4) for i in range(6)], arrivals.constant(10.0))
    assert all(r.ok for r in outcome.results)
    assert [c[0].request_id for c in calls] == [f"req-{i}" for i in range(6)]
    assert all(isinstance(view, ClusterView) and len(view.workers) == 3 for _, view, _ in calls)
    assert calls[0][0].slo_ttft_ms == 500 and calls[0][0].max_tokens == 4
    assert [now for _, _, now in calls] == pytest.approx([i / 10 for i in range(6)])
    assert sorted(completions) == [f"req-{i}" for i in range(6)]

    run = SimRun(sim.config, [], np.zeros(0))
    assert isinstance(SimRun(toy_sim().config, [], np.zeros(0)).policy, LeastLoadedPolicy)
    worker = run.workers[0]
    # The core's own classes: the simulator subclasses and replaces nothing.
    assert type(worker.scheduler) is Scheduler and type(worker.block_manager) is BlockManager
    assert type(worker.scheduler.policy) is FcfsPolicy


def test_stale_view_spreads_a_burst_with_inflight_counters(monkeypatch):
    chosen: list[tuple[str, float]] = []

    class Recording(LeastLoadedPolicy):
        def place(self, request, view, now):
            placement = super().place(request, view, now)
            chosen.append((placement.stages[0].worker_id, view.taken_at))
            return placement

    monkeypatch.setitem(policy_module._REGISTERED, "recording", Recording)
    sim = toy_sim(4, placement_policy="recording", view_refresh_s=0.1)
    sim.run([spec(i, 64, 4) for i in range(8)] + [spec(8, 64, 4)], [0.0] * 8 + [0.25])
    first_wave = [w for w, _ in chosen[:8]]
    assert sorted(first_wave) == ["w000", "w000", "w001", "w001", "w002", "w002", "w003", "w003"]
    assert [t for _, t in chosen] == pytest.approx([0.0] * 8 + [0.2])  # the snapshot of the last refresh


def test_more_workers_serve_more_goodput():
    items = [spec(i, 2048, 128) for i in range(60)]
    slo = Slo(1.0, 0.1)
    goodput = {}
    for workers in (1, 4):
        sim = Simulator.from_preset(workers, "H100", "Llama-3-8B", placement_policy="least_loaded")
        summary = summarize(sim.run(items, arrivals.poisson(30.0)).results, slo)
        assert summary.n_ok == 60
        goodput[workers] = summary.goodput_tokens_per_s
    assert goodput[4] > 2 * goodput[1]


def mixed_items() -> list:
    sessions = [Session(f"s{i}", [Round(300, 20, 0.0), Round(200, 30, 0.05), Round(100, 10, 0.02)]) for i in range(4)]
    return [spec(i, 100 + 37 * i, 5 + 11 * (i % 7)) for i in range(24)] + sessions


@pytest.mark.parametrize("policy,roles,kv_receive", [
    ("least_loaded", None, "async"), ("pd_disaggregated", ("prefill", "decode", "decode"), "async"),
    ("split", None, "async"), ("pd_disaggregated", ("prefill", "decode", "decode"), "blocking"),
    ("split", None, "blocking")])
def test_everything_finishes_and_every_block_comes_back(policy, roles, kv_receive):
    # A small KV cache: admission waits and preemption happen.
    config = toy_sim(3, placement_policy=policy, roles=roles, num_kv_blocks=120, max_num_batched_tokens=256,
                     latency=NetworkLatency(), kv_receive=kv_receive).config
    items = mixed_items()
    run = SimRun(config, items, arrivals.poisson(40.0).offsets(len(items), np.random.default_rng(1)))
    results = run.execute()
    assert len(results) == 24 + 4 * 3 and all(r.ok for r in results), [r.error for r in results if not r.ok]
    for r in results:
        assert len(r.token_times_s) == r.output_len and np.all(np.diff(r.token_times_s) >= 0)
    for worker in run.workers:
        bm = worker.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert not worker.stages and not worker.has_work() and not worker.scheduler.sequences
        assert worker.pending_receives == 0
    if policy != "least_loaded":
        assert run.stats.kv_transfers > 0
    assert sum(w.scheduler.num_preemptions for w in run.workers) == run.stats.preemptions


@pytest.mark.parametrize("policy,roles,caching,max_num_seqs,kv_receive", [
    ("least_loaded", None, True, 256, "async"), ("round_robin", None, False, 256, "async"),
    ("pd_disaggregated", ("prefill", "decode", "decode"), True, 256, "async"),
    ("pd_disaggregated", ("prefill", "decode", "decode"), True, 256, "blocking"),
    # Full running sets with requests waiting (fast-forwarded too): later stages queue for a slot.
    ("pd_disaggregated", ("prefill", "decode", "decode"), True, 3, "async"), ("round_robin", None, True, 3, "async")])
def test_fast_forward_gives_the_same_results_as_stepping(monkeypatch, policy, roles, caching, max_num_seqs,
                                                          kv_receive):
    views: list[tuple] = []

    def recording(**params):
        inner = policy_module.make_policy(policy, **params)

        class Recording:
            name = inner.name

            def place(self, request, view, now):
                views.append(view.workers)  # the loads a refresh saw, inside fast-forwarded runs too
                return inner.place(request, view, now)

        return Recording()

    monkeypatch.setitem(policy_module._REGISTERED, "recording", recording)
    items = mixed_items()
    outcomes, seen = [], []
    for fast in (False, True):
        views.clear()
        sim = toy_sim(3, placement_policy="recording", roles=roles, num_kv_blocks=150, max_num_batched_tokens=256,
                      max_num_seqs=max_num_seqs, enable_prefix_caching=caching, fast_forward=fast, view_refresh_s=0.01,
                      latency=NetworkLatency(), kv_receive=kv_receive)
        outcomes.append(sim.run(items, arrivals.poisson(30.0), seed=3))
        seen.append(list(views))
    slow, fast = outcomes
    assert [(r.request_id, r.token_times_s) for r in slow.results] == [(r.request_id, r.token_times_s)
                                                                        for r in fast.results]
    assert seen[0] == seen[1] and len(seen[0]) == len(items) + 4 * 2
    assert slow.stats.steps == fast.stats.steps and fast.stats.events < slow.stats.events
    assert slow.stats.worker_busy_fraction == pytest.approx(fast.stats.worker_busy_fraction, rel=1e-9)


def test_session_rounds_carry_history_and_wait_for_the_tool():
    session = Session("s", [Round(50, 4, 0.0), Round(30, 3, 0.5)])
    results = toy_sim().run([session]).results
    first, second = results
    assert (first.request_id, second.request_id) == ("s/r0", "s/r1")
    assert second.prompt_len == 50 + 4 + 30 and second.round_index == 1
    assert second.arrival_s == pytest.approx(first.end_s + 0.5)
    # Round 1 hits the prefix cache on the same worker: only the uncached tail is prefilled.
    assert second.ttft_s < TOY.prefill_time(0, 84)


def test_max_concurrency_and_duration_limit_as_bench_has_them():
    items = [spec(i, 64, 50) for i in range(10)]
    results = toy_sim().run(items, max_concurrency=2).results
    assert all(r.ok for r in results)
    for r in results:  # never more than two requests in flight
        assert sum(1 for o in results if o.arrival_s <= r.arrival_s < o.end_s) <= 2
    cut = toy_sim().run(items, max_concurrency=2, duration_limit_s=0.5).results
    assert any(r.ok for r in cut) and {r.error for r in cut if not r.ok} == {CUT_OFF}
    assert all(r.end_s <= 0.5 + 1e-9 for r in cut)
    closed = toy_sim().run(items, concurrency=3).results
    assert len(closed) == 10 and all(r.ok for r in closed)


def test_a_request_too_long_for_the_kv_cache_fails_like_the_engine_rejects_it():
    results = toy_sim(num_kv_blocks=10).run([spec(0, 200, 10), spec(1, 100, 10)]).results
    assert not results[0].ok and "exceeds the KV cache capacity" in results[0].error
    assert results[1].ok


def test_simulate_cli_writes_a_bench_compatible_report(tmp_path):
    out = tmp_path / "sim"
    result = CliRunner().invoke(simulate_app, ["--workers", "2", "--shape", "P256/D16", "-n", "20",
                                               "--arrival", "poisson:rate=20", "--policy", "pd_disaggregated",
                                               "--prefill-workers", "1", "--out-dir", str(out), "--per-request",
                                               "--kv-receive", "blocking"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "simulate.json").read_text())
    assert record["summary"]["n_ok"] == 20 and len(record["requests"]) == 20
    assert record["config"]["target"]["simulator"]["roles"] == ["prefill", "decode"]
    assert record["config"]["target"]["simulator"]["kv_receive"] == "blocking"
    assert (out / "simulate.csv").exists() and (out / "simulate_latency_cdf.png").exists()
    _, rows = compare(out / "simulate.json", out / "simulate.json")
    assert {row["metric"] for row in rows} >= {"goodput tokens /s", "TTFT p99 s"}
    bad = CliRunner().invoke(simulate_app, ["--policy", "nope", "-n", "2"])
    assert bad.exit_code == 2 and "unknown placement policy" in bad.output
    bad = CliRunner().invoke(simulate_app, ["--kv-receive", "eager", "-n", "2"])
    assert bad.exit_code == 2 and "kv_receive must be one of async, blocking" in bad.output


def test_simulate_cli_sweeps_rates_and_searches_capacity(tmp_path):
    """The shared rate driver (loadgen.options.run_rates): per-rate records, sweep/capacity JSON, the plot."""
    sweep = CliRunner().invoke(simulate_app, ["--workers", "2", "--shape", "P256/D16", "-n", "30",
                                              "--probe-window", "0", "--sweep-rates", "5,40", "--slo-ttft-ms", "200",
                                              "--out-dir", str(tmp_path / "sweep")])
    assert sweep.exit_code == 0, sweep.output
    record = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [p["rate"] for p in record["points"]] == [5.0, 40.0]
    assert all("simulation" in p and p["summary"]["n_ok"] == 30 for p in record["points"])
    assert (tmp_path / "sweep" / "rate-5.json").exists() and (tmp_path / "sweep" / "attainment_vs_rate.png").exists()

    search = CliRunner().invoke(simulate_app, ["--workers", "1", "--shape", "P2048/D32", "-n", "40",
                                               "--probe-window", "0", "--find-capacity", "--rate-lo", "1", "--rate-hi", "400",
                                               "--slo-ttft-ms", "300", "--out-dir", str(tmp_path / "cap")])
    assert search.exit_code == 0, search.output
    capacity = json.loads((tmp_path / "cap" / "capacity.json").read_text())["capacity"]
    assert 1.0 <= capacity["rate"] < 400.0 and "capacity" in search.output


def test_simulate_max_gap_slo_sees_decode_queueing_and_rate_max_caps_the_search(tmp_path):
    """pd_disaggregated with one decode slot: each request waits for it after its prefill, one long
    gap that each request's own p99 TBT hides and --slo-max-gap-ms counts."""
    common = ["--workers", "2", "--policy", "pd_disaggregated", "--prefill-workers", "1", "--max-num-seqs", "1",
              "--shape", "P128/D200", "-n", "12", "--arrival", "poisson:rate=50", "--slo-ttft-ms", "1000"]
    runs = {}
    for name, extra in (("p99_only", []), ("max_gap", ["--slo-max-gap-ms", "1000"])):
        result = CliRunner().invoke(simulate_app, [*common, *extra, "--out-dir", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads((tmp_path / name / "simulate.json").read_text())["summary"]
    assert runs["p99_only"]["slo_attainment"] == 1.0
    assert runs["max_gap"]["slo_attainment"] < 0.5
    assert runs["max_gap"]["slo"]["max_gap_s"] == 1.0

    capped = CliRunner().invoke(simulate_app, [*common[:-4], "-n", "12", "--probe-window", "0", "--find-capacity", "--rate-lo", "1",
                                               "--rate-hi", "2", "--rate-max", "6", "--slo-ttft-ms", "1000000",
                                               "--out-dir", str(tmp_path / "capped")])
    assert capped.exit_code == 0, capped.output
    capacity = json.loads((tmp_path / "capped" / "capacity.json").read_text())["capacity"]
    assert capacity["capped"] and capacity["rate"] == 6.0
    assert [p["rate"] for p in capacity["probes"]] == [1.0, 2.0, 4.0, 6.0]
    assert "at least 6" in capped.output

    bad = CliRunner().invoke(simulate_app, [*common, "--slo-max-gap-ms", "0"])
    assert bad.exit_code == 2 and "--slo-max-gap-ms: must be > 0" in bad.output


@pytest.mark.parametrize("num_kv_blocks,max_num_seqs", [(60, 2), (60, 4), (80, 3)])
@pytest.mark.parametrize("kv_reserve_wait_s", [0.0, 30.0])
def test_overloaded_decode_pool_never_stalls(num_kv_blocks, max_num_seqs, kv_reserve_wait_s):
    """Later stages waiting with their KV on full decode workers once deadlocked the engine's
    scheduler (the simulator ended with requests it could never finish); all must complete,
    whether prefills are sent at once (their KV then recomputed where there is no room) or
    wait for room on the decode worker first."""
    sim = toy_sim(3, placement_policy="pd_disaggregated", roles=("prefill", "decode", "decode"),
                  num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                  kv_reserve_wait_s=kv_reserve_wait_s)
    items = [spec(i, 200 + 13 * (i % 9), 20 + 7 * (i % 5)) for i in range(40)]
    outcome = sim.run(items, arrivals.poisson(500.0), seed=2)
    assert [r.error for r in outcome.results if not r.ok] == []
    assert outcome.stats.kv_transfers > 0
    if kv_reserve_wait_s:  # sent only with room for their KV: nothing recomputed
        assert outcome.stats.kv_reserve_waits > 0 and outcome.stats.kv_recomputes == 0
    else:
        assert outcome.stats.preemptions > 0


def _one_decode_slot_sim(kv_reserve_wait_s: float) -> Simulator:
    """1P1D whose decode worker holds the KV of two 240-token requests (30 blocks of 16 tokens)."""
    return toy_sim(2, placement_policy="pd_disaggregated", roles=pd_roles(2, 1), num_kv_blocks=30,
                   kv_reserve_wait_s=kv_reserve_wait_s)


def test_a_prefill_waits_in_line_for_room_for_its_kv_instead_of_recomputing_on_the_decode_worker():
    items = [spec(i, 200, 40) for i in range(6)]  # all at once: the decode worker has room for 2
    waited = _one_decode_slot_sim(30.0).run(items, [0.0] * 6)
    at_once = _one_decode_slot_sim(0.0).run(items, [0.0] * 6)
    for outcome in (waited, at_once):
        assert all(r.ok and r.output_len == 40 for r in outcome.results)
    assert waited.stats.kv_recomputes == 0 and waited.stats.kv_transfers == 6
    assert waited.stats.kv_reserve_waits == 4 and waited.stats.kv_reserve_wait_s > 0
    assert at_once.stats.kv_recomputes == 4 and at_once.stats.kv_reserve_waits == 0
    # In line, first come first served: the prefills run (and the first tokens come) in arrival order.
    firsts = [r.first_token_s for r in waited.results]
    assert firsts == sorted(firsts)
    # A decode worker that never recomputes a prompt: every gap after the first token is a decode step.
    assert max(max(r.itls_s) for r in waited.results) < max(max(r.itls_s) for r in at_once.results)


def test_a_wait_for_room_that_runs_out_sends_the_stage_and_the_next_one_recomputes():
    items = [spec(i, 200, 40) for i in range(3)]  # the first two decode for ~90 ms: the third waits past 50 ms
    outcome = _one_decode_slot_sim(0.05).run(items, [0.0] * 3)
    assert all(r.ok and r.output_len == 40 for r in outcome.results)
    assert outcome.stats.kv_reserve_waits == 1 and outcome.stats.kv_recomputes == 1
    assert outcome.stats.kv_reserve_wait_s == pytest.approx(0.05)
    assert outcome.stats.virtual_s == max(r.end_s for r in outcome.results) - NO_DELAY.stream_s


def test_fast_forward_never_takes_a_one_token_recompute_chunk_for_a_decode():
    """A token budget equal to the running count: a later stage recomputing from tokens
    advances one token per step past its prompt, sampling nothing; it is not a decode run."""
    from array import array

    from services.planner.sim_run import VirtualClock
    from services.planner.sim_worker import SimWorker, StageRun

    def run(fast: bool):
        clock = VirtualClock()
        worker = SimWorker("w", TOY, clock=clock, num_kv_blocks=100, max_num_batched_tokens=2, max_num_seqs=2,
                           fast_forward=fast)
        a = StageRun(StageKey("a", 0), 0, 40, worker, array("d"))
        worker.add_stage(a, list(range(2, 12)), 10, 30, 0, 0.0)
        # No KV arrived: prompt (10) and 5 earlier outputs are recomputed from tokens.
        b = StageRun(StageKey("b", 1), 15, 40, worker, array("d"))
        worker.add_stage(b, list(range(2, 12)) + [1] * 5, 10, 30, 0, 0.0)
        while worker.has_work():
            clock.now = worker.start_step(clock.now)
            worker.finish_step(clock.now)
        return list(a.token_times), list(b.token_times), worker.num_steps

    assert run(True) == run(False)


@pytest.mark.parametrize("args, message", [
    (["--find-capacity", "--rate-hi", "8", "--rate-max", "4"], "--rate-max: must be finite and >= --rate-hi"),
    (["--find-capacity", "--rate-max", "inf"], "--rate-max: must be finite"),
    (["--rate-max", "20"], "--rate-max bounds the capacity search"),
])
def test_simulate_rejects_bad_rate_max(args, message):
    result = CliRunner().invoke(simulate_app, ["--shape", "P64/D4", "-n", "4", *args])
    assert result.exit_code == 2 and message in result.output, result.output
