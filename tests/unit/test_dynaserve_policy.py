"""The `dynaserve` placement policy (Alg. 1) over hand-made views: split points, balance,
orientation, feedback."""

from __future__ import annotations

import pytest

import math

from services.global_scheduler.dynaserve import DynaServePolicy, KvFootprints
from services.global_scheduler.policy import (ClusterView, CompletionReport, PlacementRequest, WorkerView,
                                              make_policy, orient_kv_transfers)
from services.global_scheduler.compute_clock import ComputeClock
from services.global_scheduler.timeline import MicroRequest, WorkerTimeline
from splitserve.perf.presets import preset
from splitserve.core.records import WorkerLoad

PERF = preset("A100", "qwen2.5-14b")
NOW = 1000.0


def view(*worker_ids: str, role: str = "both", busy: bool = True) -> ClusterView:
    # "busy": the snapshots show work, so the policy's own timelines are what it goes by.
    return ClusterView(tuple(WorkerView(w, f"{w}:1", WorkerLoad(w, role=role, running=1 if busy else 0,
                                                                   total_blocks=100, free_blocks=50))
                             for w in worker_ids), NOW - 0.05)


def request(rid: str = "r", prompt: int = 2048, max_tokens: int = 1024, hint: int = 512, **kw) -> PlacementRequest:
    return PlacementRequest(rid, prompt, max_tokens, predicted_output_len=hint, **kw)


def policy(**kw) -> DynaServePolicy:
    """No bias towards whole requests (the paper's objective alone: balance) unless a test asks."""
    return DynaServePolicy(perf_model=PERF, **{"whole_bias": 0.0, **kw})


def load(p: DynaServePolicy, worker_id: str, n: int, prefill: int = 1024, decode: int = 256) -> None:
    """`n` requests already placed on `worker_id` (its timeline and its compute clock)."""
    timeline = p.timelines.setdefault(worker_id, WorkerTimeline(PERF, p.token_budget, NOW))
    clock = p.clocks.setdefault(worker_id, ComputeClock())
    for i in range(n):
        micro = MicroRequest(f"bg-{worker_id}-{i}", prefill, 0, decode)
        predicted = timeline.commit(micro)
        clock.add(micro.key, p._work(micro), timeline.time_of_pass(predicted.first_pass), predicted.finish_time)
    p._last_placed[worker_id] = NOW


def test_cold_start_is_prefill_decode_disaggregation():
    p = policy()
    placement = p.place(request(), view("w0", "w1"), NOW)
    assert [(s.worker_id, s.start, s.end) for s in placement.stages] == [("w0", 0, 2048), ("w1", 2048, 3072)]
    assert placement.decision["phi"] == pytest.approx(2048 / (2048 + 512))
    # No search on an idle pair: the disaggregated split, and the two whole options beside it.
    assert placement.decision["probes"] == 3 and placement.policy == "dynaserve"
    assert placement.decision["predicted_output_len"] == 512


def test_the_split_moves_towards_the_idle_worker():
    busy_alpha, busy_beta = policy(), policy()
    load(busy_alpha, "w0", 12)
    load(busy_beta, "w1", 12)
    a = busy_alpha.place(request(), view("w0", "w1"), NOW)
    b = busy_beta.place(request(), view("w0", "w1"), NOW)
    # w0 (alpha's worker) loaded: less of the request there than when w1 is the loaded one.
    assert a.decision["phi"] < b.decision["phi"]
    assert a.decision["probes"] <= busy_alpha.max_probes + 2  # the search, then both whole options
    for placement in (a, b):  # predicted drain times of the chosen plan come with it
        assert placement.decision["t1_s"] > 0 and placement.decision["t2_s"] > 0


def test_a_badly_overloaded_worker_gets_nothing_no_split():
    p = policy()
    load(p, "w0", 200, prefill=2048, decode=512)
    placement = p.place(request(), view("w0", "w1"), NOW)
    assert [(s.worker_id, s.start, s.end) for s in placement.stages] == [("w1", 0, 3072)]
    assert placement.decision["phi"] == 0.0


def test_alpha_runs_on_the_lower_ranked_worker_so_its_kv_can_be_pushed():
    p = policy()
    v = ClusterView((WorkerView("a-decode", "x:1", WorkerLoad("a-decode", role="decode", running=1)),
                     WorkerView("z-prefill", "y:1", WorkerLoad("z-prefill", role="prefill", running=1))), NOW)
    placement = p.place(request(), v, NOW)
    assert placement.stages[0].worker_id == "z-prefill"
    oriented = orient_kv_transfers(placement, v)
    assert [s.push_kv for s in oriented.stages] == [True, False]


def test_the_hint_wins_and_is_clamped_to_max_tokens():
    p = policy()
    assert p.predicted_output_len(request(hint=100)) == 100
    assert p.predicted_output_len(request(hint=5000, max_tokens=300)) == 300
    assert p.predicted_output_len(request(hint=None)) == 128  # cold: the prior (the predictor's default)
    for i in range(50):  # it learns from finished requests
        p.on_completion(CompletionReport(f"done{i}", "stop", prompt_tokens=2048, output_tokens=300))
    assert p.predicted_output_len(request(hint=None)) == 300 + 20


def test_completions_take_the_request_out_of_the_timelines():
    p = policy()
    load(p, "w0", 3)
    load(p, "w1", 3)
    before = {w: t.drain_time for w, t in p.timelines.items()}
    placement = p.place(request(), view("w0", "w1"), NOW)
    assert any(p.timelines[w].drain_time > before[w] for w in before)
    p.on_completion(CompletionReport("r", "length", prompt_tokens=2048, output_tokens=512,
                                     worker_ids=placement.worker_ids))
    for w, drain in before.items():
        assert p.timelines[w].drain_time == pytest.approx(drain, rel=1e-9)


def test_a_worker_that_reports_itself_idle_is_idle():
    p = policy()
    load(p, "w0", 30)
    idle = ClusterView((WorkerView("w0", "w0:1", WorkerLoad("w0", running=0)),
                        WorkerView("w1", "w1:1", WorkerLoad("w1", running=0))), NOW + 1)  # after the last placement
    placement = p.place(request(), idle, NOW + 2)
    assert placement.decision["probes"] == 3  # both idle again: the cold-start split (and no split)


def test_registered_and_built_with_the_deployments_perf_model():
    built = make_policy("dynaserve", deployment_perf_model=PERF, max_probes="4")
    assert isinstance(built, DynaServePolicy) and built.perf_model is PERF and built.max_probes == 4
    named = make_policy("dynaserve", deployment_perf_model=None, perf_model="datasheet:A100/qwen2.5-14b")
    assert named.perf_model == PERF  # the same preset, named
    measured = make_policy("dynaserve", deployment_perf_model=None, perf_model="aiconfigurator:A100/qwen2.5-14b")
    assert measured.perf_model.backend == "aiconfigurator" and measured.perf_model.tables is not None
    with pytest.raises(ValueError, match="max_probes"):
        make_policy("dynaserve", deployment_perf_model=PERF, max_probes="0")
    with pytest.raises(ValueError, match="perf model"):
        make_policy("dynaserve", perf_model="nonsense")


def test_one_worker_serves_colocated():
    placement = policy().place(request(), view("w0"), NOW)
    assert [(s.worker_id, s.start, s.end) for s in placement.stages] == [("w0", 0, 3072)]


def test_every_plan_tiles_the_request_and_respects_the_probe_budget():
    p = policy(max_probes=3)
    for i in range(40):
        placement = p.place(request(f"r{i}", prompt=100 + 97 * i, max_tokens=50 + 31 * i, hint=20 + 17 * i),
                            view("w0", "w1", "w2"), NOW + i * 0.05)
        assert placement.stages[0].start == 0 and placement.stages[-1].end == 100 + 97 * i + 50 + 31 * i
        assert placement.decision["probes"] <= 3 + 2


def test_the_balance_is_over_compute_not_drain_times():
    """With both workers equally busy a prefill-heavy request is cut where its prefill ends
    (alpha prefills, beta decodes): over drain times T2 always came after T1, since the second
    stage waits for the first, and beta never got the decodes either (docs/benchmarks.md,
    DynaServe evaluation)."""
    p = policy()
    load(p, "w0", 12)
    load(p, "w1", 12)
    placement = p.place(request(), view("w0", "w1"), NOW)
    assert [(s.start, s.end) for s in placement.stages] == [(0, 2048), (2048, 3072)], placement.reason
    assert placement.decision["t1_s"] > placement.decision["t2_s"]  # beta's decodes cost little compute


def test_a_cut_inside_the_prompt_counts_betas_wait_for_alphas_kv():
    """Beta's worker cannot start the rest of the prompt before alpha's KV is in: T2 is
    max(its backlog, T1 + hand-off) + beta's work, not backlog + work (that balance gave alpha
    half of every long prompt and left beta's worker idle before each suffix)."""
    p = policy()
    a, b = (WorkerTimeline(PERF, p.token_budget, NOW) for _ in range(2))
    handoff = PERF.kv_transfer_time(p.kv_chunk_tokens)
    for load_a, load_b in ((1.0, 0.2), (0.2, 5.0)):
        option = p._evaluate(request(), 512, 0.4, a, b, load_a, load_b, NOW)
        assert 0 < option.split < 2047 and option.beta_request.prefill > 1
        assert option.t_alpha == pytest.approx(load_a + p._work(option.alpha_request))
        assert option.t_beta == pytest.approx(max(load_b, option.t_alpha + handoff) + p._work(option.beta_request))
    # a cut in the output leaves beta decodes, which run beside its other work: no wait counted
    option = p._evaluate(request(), 512, 0.9, a, b, 1.0, 0.2, NOW)
    assert option.beta_request.prefill == 0
    assert option.t_beta == pytest.approx(0.2 + p._work(option.beta_request))


@pytest.mark.parametrize("loads", [(0, 0), (2, 2), (5, 2), (2, 5)])
def test_a_long_prompt_is_not_cut_inside_it(loads):
    """P8192/D32: a cut inside the prompt shortens nothing (its two parts run one after the
    other) and costs beta's worker a wait; the request runs whole on the worker that frees up
    first, or alpha prefills it all (cut at P - 1, beta takes the decodes)."""
    p = policy(whole_bias=1.0)
    for worker_id, n in zip(("w0", "w1"), loads):
        if n:
            load(p, worker_id, n, prefill=8192, decode=32)
    placement = p.place(request(prompt=8192, max_tokens=32, hint=32), view("w0", "w1"), NOW)
    cuts = _cut_points(placement)
    assert cuts in ([], [8191]), placement.reason
    if not cuts and loads[0] != loads[1]:
        assert placement.worker_ids == (("w0",) if loads[0] < loads[1] else ("w1",))


def test_a_stream_of_requests_splits_the_compute_evenly():
    """Many identical requests on an idle pair: both workers end up with about the same compute."""
    p = policy()
    workers = view("w0", "w1")
    for i in range(200):
        p.place(request(f"s{i}"), workers, NOW + i * 0.2)
    loads = [p.clocks[w].backlog(NOW + 40) for w in ("w0", "w1")]
    assert min(loads) > 0.8 * max(loads)


# ---- where the hand-off lands, and KV memory ----------------------------------------------------


def _cut_points(placement) -> list[int]:
    return [s.end for s in placement.stages[:-1]]


@pytest.mark.parametrize("hint, min_output_split, loads, expected", [
    (28, 128, (0, 0), 2047),  # cold start: PD's cut at the prompt's end would sample on alpha
    (28, 128, (1, 2), "whole"),  # beta busier: the search gives alpha all of it, no cut in the output
    (28, 1, (0, 0), 2048),  # anywhere (the paper's phi): the same requests cut in their output
    (28, 1, (1, 1), "output"),
    (512, 128, (0, 1), "output"),  # enough gaps that one hand-off does not set the p99
])
def test_short_outputs_are_cut_inside_the_prompt(hint, min_output_split, loads, expected):
    """For a short output the hand-off gap would be its p99 TBT: the cut moves just inside the
    prompt, where the wait counts in the TTFT."""
    p = policy(min_output_split_tokens=min_output_split)
    for worker_id, n in zip(("w0", "w1"), loads):
        if n:
            load(p, worker_id, n, prefill=2048, decode=64)
    placement = p.place(request(prompt=2048, max_tokens=hint, hint=hint), view("w0", "w1"), NOW)
    cuts = _cut_points(placement)
    if expected == "whole":
        assert cuts == [] and placement.decision["phi"] == 1.0, placement.reason
        return
    assert len(cuts) == 1, placement.reason
    if expected == "output":
        assert cuts[0] >= 2048
    else:
        assert cuts[0] == expected


def _kv_view(capacity_tokens: int) -> ClusterView:
    blocks = capacity_tokens // 16
    return ClusterView(tuple(WorkerView(w, f"{w}:1", WorkerLoad(w, role="both", running=1, total_blocks=blocks,
                                                                   free_blocks=blocks, block_size=16))
                             for w in ("w0", "w1")), NOW - 0.05)


def test_a_split_that_would_overflow_a_workers_kv_is_not_made():
    """Cold start splits P/D (w0 -> w1); with w1's KV committed to requests in flight the
    request runs whole on w0 instead of recomputing or preempting on w1, until they end."""
    capacity = 4 * 2560
    p = policy()
    first = p.place(request("r0"), _kv_view(capacity), NOW)
    assert [s.worker_id for s in first.stages] == ["w0", "w1"]
    p.on_completion(CompletionReport("r0", "length", prompt_tokens=2048, output_tokens=512,
                                     worker_ids=first.worker_ids))
    p.footprints["w1"].add("in-flight", capacity - 2000, math.inf)  # reported when it ends
    second = p.place(request("r1"), _kv_view(capacity), NOW)
    assert [s.worker_id for s in second.stages] == ["w0"], second.reason
    assert p.footprints["w0"].held(NOW) == 2560
    p.footprints["w1"].remove("in-flight")
    third = p.place(request("r2"), _kv_view(capacity), NOW)
    assert "w1" in third.worker_ids


def test_kv_footprints_end_when_reported_or_predicted():
    f = KvFootprints()
    f.add("alpha", 2048, ends_at=10.0)
    f.add("beta", 2560, ends_at=math.inf)
    assert f.held(5.0) == 4608
    assert f.held(10.0) == 2560  # alpha's predicted end: its KV was pushed and freed
    f.remove("beta")
    assert f.held(11.0) == 0
    f.add("again", 100, ends_at=20.0)
    f.add("again", 300, ends_at=30.0)  # re-placed: replaces, not adds
    assert f.held(25.0) == 300  # the first placement's expiry does not take the second's
    assert f.held(30.0) == 0


@pytest.mark.parametrize("prompt, output, whole_bias, loads, expect_split", [
    (219, 1467, 1.0, (2, 3), False),  # decode-heavy: whole, on the less loaded worker
    (219, 1467, 0.0, (2, 2), True),  # the paper's objective alone: split for balance
])
def test_decode_heavy_requests_run_whole(prompt, output, whole_bias, loads, expect_split):
    p = policy(whole_bias=whole_bias)
    load(p, "w0", loads[0], prefill=prompt, decode=output)
    load(p, "w1", loads[1], prefill=prompt, decode=output)
    placement = p.place(request(prompt=prompt, max_tokens=output, hint=output), view("w0", "w1"), NOW)
    assert (len(placement.stages) == 2) == expect_split, placement.reason
    if not expect_split:
        assert placement.worker_ids == ("w0",)  # the less loaded one


def test_whole_bias_must_not_be_negative():
    with pytest.raises(ValueError, match="whole_bias"):
        policy(whole_bias=-0.5)


def test_a_one_token_output_is_never_split():
    """alpha would sample the only token: the whole request runs there (no KV moved for nothing)."""
    p = policy()
    placement = p.place(request(prompt=2048, max_tokens=1, hint=1), view("w0", "w1"), NOW)
    assert len(placement.stages) == 1


def test_with_the_defaults_probes_stay_within_their_bound():
    p = DynaServePolicy(perf_model=PERF)
    load(p, "w0", 4, prefill=219, decode=1467)
    load(p, "w1", 6, prefill=219, decode=1467)
    for i, (prompt, output) in enumerate([(219, 1467), (2048, 512), (8192, 32), (1000, 200)]):
        placement = p.place(request(f"r{i}", prompt=prompt, max_tokens=output, hint=output), view("w0", "w1"), NOW)
        assert placement.decision["probes"] <= p.max_probes + 2
        assert sum(s.end - s.start for s in placement.stages) == prompt + output


@pytest.mark.parametrize("prompt, output", [(8192, 32), (2048, 512), (500, 300), (219, 1467)])
def test_the_search_never_cuts_before_the_prompts_end(prompt, output):
    """A cut before P - 1 finishes no earlier than the request whole on alpha (the halves of a
    prompt run one after the other): whatever the loads, no placement cuts there."""
    for n0 in range(0, 5):
        for n1 in range(0, 5):
            p = policy()
            load(p, "w0", n0, prefill=1024, decode=256)
            load(p, "w1", n1, prefill=1024, decode=256)
            placement = p.place(request(prompt=prompt, max_tokens=output, hint=output), view("w0", "w1"), NOW)
            assert all(cut >= prompt - 1 for cut in _cut_points(placement)), (n0, n1, placement.reason)
            assert placement.decision["probes"] <= p.max_probes + 2


def test_the_search_stops_when_alpha_is_the_bottleneck_with_the_prompt_alone():
    p = policy()
    load(p, "w0", 12)
    placement = p.place(request(), view("w0", "w1"), NOW)
    assert placement.decision["probes"] == 1 + 2  # the cut at P, then the two whole options


def test_a_lost_completion_report_stops_counting_after_its_grace():
    p = policy()
    first = p.place(request("r0"), _kv_view(4 * 2560), NOW)
    assert p.footprints["w1"].held(NOW) >= 2500 and "w1" in first.worker_ids
    # No report ever comes (its coordinator died): gone after twice its predicted life and a minute.
    assert p.footprints["w1"].held(NOW + 10_000) == 0


def test_prompt_cuts_open_the_papers_whole_range_and_still_count_betas_wait():
    """`prompt_cuts=true` (the experiment of benchmarks/dynaserve_prompt_cuts.py) is the paper's
    search: below P - 1 when alpha is the busier worker, T2 without beta's wait for alpha's KV."""
    found = []
    for n0 in range(0, 6):
        p = policy(prompt_cuts="true", always_split=True)
        load(p, "w0", n0, prefill=1024, decode=256)
        placement = p.place(request(prompt=2048, max_tokens=512, hint=512), view("w0", "w1"), NOW)
        assert placement.decision["probes"] <= p.max_probes + 2
        found += [cut for cut in _cut_points(placement) if cut < 2047]
    assert found, "no load made the search cut inside the prompt"
    p = policy(prompt_cuts=True)
    option = p._evaluate(request(prompt=2048, max_tokens=512, hint=512), 512, 0.3, *_pair(p))
    assert 0 < option.split < 2047 and option.beta_request.prefill > 1
    assert option.t_beta == pytest.approx(p._work(option.beta_request))  # load 0, no wait counted
    waited = policy()._evaluate(request(prompt=2048, max_tokens=512, hint=512), 512, 0.3, *_pair(policy()))
    assert waited.t_beta >= waited.t_alpha + p._work(waited.beta_request) - 1e-12
    with pytest.raises(ValueError, match="prompt_cuts"):
        policy(prompt_cuts="sometimes")


def _pair(p: DynaServePolicy):
    """Two idle timelines and zero loads, as `_evaluate` takes them."""
    a = p.timelines.setdefault("w0", WorkerTimeline(PERF, p.token_budget, NOW))
    b = p.timelines.setdefault("w1", WorkerTimeline(PERF, p.token_budget, NOW))
    return a, b, 0.0, 0.0, NOW
