"""Multi-turn workload for LAPS (loadgen.multiturn), the evaluation's helpers (benchmarks/laps_multiturn.py)
and benchmarks/laps_eval.py's classification by new tokens and --perf-backend plumbing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from loadgen.multiturn import (FIGURE2, ConversationShape, generate_conversations, lognormal_median_for,
                               mooncake_turn_stats, mooncake_turns, new_token_stats, rounds_of, split_by_class)
from loadgen.sessions import Round, Session, ToolDelay
from loadgen.traces import TraceRequest
from services.planner.sim_workload import SimRequestSpec, requests_from_trace
from services.planner.simulator import Simulator, pd_roles
from splitserve.perf.backends import perf_model_for

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


le = _load("laps_eval")
lm = sys.modules["laps_multiturn"]  # imported by laps_eval


# ---- loadgen.multiturn ------------------------------------------------------------------

def test_lognormal_median_puts_the_share_below_the_threshold():
    for share, sigma in ((0.63, 1.39), (0.81, 1.39), (0.5, 0.7)):
        median = lognormal_median_for(share, 256, sigma)
        assert NormalDist().cdf(np.log(256 / median) / sigma) == pytest.approx(share)
    assert lognormal_median_for(0.5, 256, 2.0) == pytest.approx(256)
    with pytest.raises(ValueError):
        lognormal_median_for(1.0, 256, 1.0)


def test_conversations_match_figure2_shares_and_respect_the_context():
    shape = ConversationShape(mean_turns=3.0, max_context=8192)
    sessions = generate_conversations(shape, 4000, np.random.default_rng(1))
    stats = new_token_stats(sessions)
    assert stats["first"]["below_256"] == pytest.approx(FIGURE2["first_below"], abs=0.03)
    assert stats["later"]["below_256"] == pytest.approx(FIGURE2["later_below"], abs=0.03)
    assert 0.5 < stats["later_share"] < 0.7  # 1 + Poisson(2) turns, some cut by the context
    for s in sessions:
        assert s.rounds and s.rounds[0].delay_before_s == 0.0
        assert s.context_len(len(s.rounds) - 1) + s.rounds[-1].output_len <= 8192
    again = generate_conversations(shape, 4000, np.random.default_rng(1))
    assert [s.rounds for s in again] == [s.rounds for s in sessions]


def test_conversations_draw_turns_and_outputs_from_the_given_samples():
    shape = ConversationShape(turns=(2,), outputs=(7, 9), think_time=ToolDelay("constant", 2.0))
    sessions = generate_conversations(shape, 50, np.random.default_rng(0))
    assert all(len(s.rounds) == 2 for s in sessions)
    assert {r.output_len for s in sessions for r in s.rounds} <= {7, 9}
    assert all(s.rounds[1].delay_before_s == 2.0 for s in sessions)


def _row(ids, prompt_len, t=0.0):
    return TraceRequest(t, prompt_len, 10, tuple(ids), 512)


def test_mooncake_turns_follow_shared_prefixes_beyond_the_system_block():
    rows = [_row([0, 1, 2], 1400), _row([0, 1, 2, 3], 1900), _row([0, 9], 700), _row([0, 1, 2, 3, 4], 2500),
            _row([0, 9, 10], 1200)]
    turns = mooncake_turns(rows)
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (0, 1), (2, 0), (0, 2), (2, 1)]
    assert (turns[1].history, turns[1].new_tokens) == (1536, 364)
    assert (turns[3].history, turns[3].new_tokens) == (2048, 452)
    assert (turns[2].history, turns[2].new_tokens) == (0, 700)  # only the shared first block: a new conversation
    anyprefix = mooncake_turns(rows, min_shared_blocks=1)
    assert anyprefix[2].history == 512 and anyprefix[2].turn == 2  # after the latest row holding block 0
    stats = mooncake_turn_stats(turns)
    assert stats["conversations"] == 2 and stats["mean_turns"] == 2.5
    assert stats["later"]["n"] == 3


def test_classes_by_new_tokens_on_the_history_not_by_the_prompt():
    session = Session("s", [Round(3000, 200, 0.0), Round(100, 50, 1.0), Round(900, 10, 1.0)])
    rows = rounds_of([session])
    assert rows == [("s/r0", 0, 0, 3000), ("s/r1", 1, 3200, 100), ("s/r2", 2, 3350, 900)]
    classes = split_by_class(rows, lambda h: 256.0)
    assert classes == {"s/r0": False, "s/r1": True, "s/r2": False}  # r1's prompt is 3,300 tokens, but short
    model = perf_model_for("H200", "Qwen2.5-14B", backend="datasheet")
    assert split_by_class([("x", 1, 8192, 64)], model.prefill_boundary) == {"x": True}
    assert split_by_class([("x", 0, 0, 8256)], model.prefill_boundary) == {"x": False}


# ---- benchmarks/laps_multiturn.py -------------------------------------------------------

def _sessions(n=24, rounds=3):
    return [Session(f"c-{i}", [Round(300 if j == 0 else 40, 8, 0.0 if j == 0 else 0.01) for j in range(rounds)])
            for i in range(n)]


def test_pd_session_keeps_the_history_where_pd_disaggregated_recomputes_it():
    pulls = {}
    for policy in ("pd_disaggregated", "pd_session"):
        sim = Simulator.from_preset(4, "H200", "Qwen2.5-14B", perf_backend="datasheet", roles=pd_roles(4, 2),
                                    placement_policy=policy, policy_params={"prefill_routing": "round_robin"})
        outcome = sim.run(_sessions(), None, concurrency=8)
        assert all(r.ok for r in outcome.results) and len(outcome.results) == 72
        pulls[policy] = outcome.stats.kv_pulls
    assert pulls["pd_session"] == 48  # every later round pulls its history from the session's decode worker
    assert pulls["pd_disaggregated"] < pulls["pd_session"]


def test_class_closed_loop_keeps_each_class_at_its_clients():
    sim = Simulator.from_preset(1, "H200", "Qwen2.5-32B", perf_backend="datasheet", batch_policy="fcfs")
    make = {"long": lambda n: SimRequestSpec(f"long-{n}", 2000, 1), "short": lambda n: SimRequestSpec(f"short-{n}", 32, 1)}
    run = lm.ClassClosedLoop(sim.config, {"long": 1, "short": 3}, make, duration_s=5.0)
    results = run.execute()
    done = [r for r in results if r.ok]
    stream = sim.config.latency.stream_s  # a client's next send leaves when the engine finished, before the stream
    for cls, clients in (("long", 1), ("short", 3)):
        mine = [r for r in done if r.request_id.startswith(cls + "-")]
        assert len(mine) > 3
        for r in mine:  # requests of a class in flight when r arrived: at most its clients
            overlapping = sum(1 for o in mine if o.arrival_s <= r.arrival_s < o.end_s - stream - 1e-9)
            assert overlapping <= clients


def test_interference_reports_both_classes_alone_and_mixed():
    result = lm.interference("H200", "Qwen2.5-32B", "datasheet", levels=(2,), duration_s=6.0, warmup_s=1.0,
                             log=lambda msg: None)
    mixes = {(r["policy"], r["mix"]) for r in result["rows"]}
    assert mixes == {("fcfs", "long alone"), ("fcfs", "short alone"), ("fcfs", "mixed"), ("fcfs", "long 4 + short"),
                     ("laps", "mixed")}
    assert "datasheet roofline" in result["step_times"]
    mixed = next(r for r in result["rows"] if (r["policy"], r["mix"]) == ("fcfs", "mixed"))
    alone = next(r for r in result["rows"] if r["mix"] == "short alone")
    assert mixed["short_p90_ms"] > alone["short_p90_ms"]  # Figure 3's direction: shorts wait behind longs
    assert "| 2 |" in lm.interference_markdown(result)


# ---- benchmarks/laps_eval.py ----------------------------------------------------------------

def test_trace_rounds_take_the_shared_prefix_as_history():
    rows = [_row([0, 1], 1000), _row([0, 1, 2], 1300), TraceRequest(0.0, 50, 5)]
    assert le.trace_rounds(rows[:2], "m") == [("m-0", 0, 0, 1000), ("m-1", 0, 1024, 276)]
    assert le.trace_rounds([rows[2]], "a") == [("a-0", 0, 0, 50)]


def test_session_workload_prefills_and_classes_use_the_turns_history():
    sessions = [Session("s", [Round(3000, 200, 0.0), Round(100, 50, 1.0)])]
    workload = le.Workload("multiturn", sessions, rounds_of(sessions), sessions=True)
    model = perf_model_for("H200", "Qwen2.5-14B", backend="datasheet")
    assert list(workload.prefill_s(model)) == [model.prefill_time(0, 3000), model.prefill_time(3200, 100)]
    assert workload.classes(model) == {"s/r0": False, "s/r1": True}
    assert workload.rounds_per_item == 2
    assert le.decode_instances(model, workload, "spatial") >= le.DEPLOYMENTS["spatial"][1]
    assert workload.at_rate(1.0) is workload  # no factory: as given


def test_a_poisson_run_offers_a_window_of_the_trace_not_a_fixed_count():
    rows = [_row([0, 1], 1000), _row([0, 1, 2], 1300), _row([5], 700), _row([0, 1, 2, 3], 1600)]
    specs = requests_from_trace(rows, "m")
    workload = le.Workload("m", specs, le.trace_rounds(rows, "m"))
    assert workload.for_window(1.0, 2.0, 1).rounds == workload.rounds[:2]  # 2 s at 1 req/s
    assert workload.for_window(1.0, 2.0, 3).items == specs[:3]  # at least --requests
    assert workload.for_window(10.0, 60.0, 1) is workload  # a trace offers at most all its rows
    # A prefix of the trace keeps each row's history (it counts earlier rows only).
    assert workload.first(2).rounds == le.trace_rounds(rows[:2], "m")
    sessions = [Session("s", [Round(100, 5, 0.0)])]
    conversations = le.Workload("multiturn", sessions, rounds_of(sessions), sessions=True)
    assert conversations.first(0) is conversations and conversations.for_window(5.0, 60.0, 1) is conversations


def test_run_one_says_whether_the_run_reached_a_steady_state():
    # One prefill instance at twice its rate: its queue grows until the arrivals stop.
    specs = [SimRequestSpec(f"r-{i}", 4000, 2) for i in range(400)]
    workload = le.Workload("long", specs, [(s.request_id, 0, 0, s.prompt_len) for s in specs])
    model = perf_model_for("H200", "Qwen2.5-14B", backend="datasheet")
    rate = 2.0 / model.prefill_time(0, 4000)
    row = le.run_one("H200", "Qwen2.5-14B", "temporal", "vanilla PD", workload, ("rate", rate), 0, "datasheet")
    assert not row["steady"] and row["steady_reasons"]
    light = le.run_one("H200", "Qwen2.5-14B", "temporal", "vanilla PD", workload, ("rate", rate / 4), 0, "datasheet")
    assert light["steady"] and not light["steady_reasons"] and light["violation_rate"] < row["violation_rate"]


def test_run_one_records_which_backend_timed_it():
    specs = [SimRequestSpec(f"r-{i}", 64 if i % 2 else 3000, 4) for i in range(12)]
    rounds = [(s.request_id, 0, 0, s.prompt_len) for s in specs]
    workload = le.Workload("tiny", specs, rounds)
    row = le.run_one("H200", "Qwen2.5-14B", "temporal", "LAPS", workload, ("concurrency", 4), 0, "datasheet")
    datasheet = perf_model_for("H200", "Qwen2.5-14B", backend="datasheet")
    assert row["perf_backend"] == datasheet.backend and row["step_times"] == datasheet.timing_note
    assert "datasheet roofline" in row["step_times"]
    assert row["short_n"] == 6 and row["long_n"] == 6 and row["ok"] == 12
    pytest.importorskip("aiconfigurator_core")
    row = le.run_one("H200", "Qwen2.5-14B", "temporal", "vanilla PD", workload, ("rate", 5.0), 0, "auto")
    assert row["perf_backend"] == "aiconfigurator" and "measured GPU data" in row["step_times"]


def test_compare_matches_rates_by_load_factor_across_backends():
    lc = _load("laps_compare")

    def row(system, load, value, mean, viol):
        return dict(model="M", deployment="spatial", workload="w", load=load, value=value, system=system,
                    ttft_mean_ms=mean, ttft_p90_ms=2 * mean, violation_rate=viol)

    measured = {"rows": [row("vanilla PD", "rate", 10.0, 100, 0.2), row("LAPS", "rate", 10.0, 50, 0.1),
                         row("vanilla PD", "rate", 20.0, 200, 0.4), row("LAPS", "rate", 20.0, 100, 0.2),
                         row("vanilla PD", "concurrency", 64, 80, 0.0), row("LAPS", "concurrency", 64, 40, 0.0)]}
    datasheet = {"rows": [row("vanilla PD", "rate", 6.0, 100, 0.2), row("LAPS", "rate", 6.0, 90, 0.2),
                          row("vanilla PD", "rate", 12.0, 100, 0.2), row("LAPS", "rate", 12.0, 150, 0.3),
                          row("vanilla PD", "concurrency", 64, 80, 0.0), row("LAPS", "concurrency", 64, 80, 0.0)]}
    assert ("M", "spatial", "w", "0.7x", "LAPS") in lc.keyed(measured["rows"], [0.4, 0.7])
    table = lc.compare_table({"measured": measured, "datasheet": datasheet}, [0.4, 0.7])
    assert "| M | spatial | w | 0.7x | vanilla PD | -50% / -50% / – / – | +50% / +50% / – / – |" in table
    assert "| M | spatial | w | c=64 | vanilla PD | -50% / -50% / – / – | +0% / +0% / – / – |" in table
    assert "40.0%→20.0%" in table
