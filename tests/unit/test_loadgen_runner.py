"""The benchmark runner and reports against an in-process fake target (tiny real delays)."""

from __future__ import annotations

import asyncio
import csv
import json
import time

import numpy as np
import pytest

from loadgen.arrivals import constant
from loadgen.metrics import Slo, summarize
from loadgen.plan import BenchRequest, PlannedRound, SessionPlan, StreamedResult
from loadgen.plots import plot_attainment_vs_rate, plot_latency_cdfs, plot_timeline
from loadgen.report import compare, run_record, write_csv, write_json
from loadgen.runner import CUT_OFF, run_benchmark

SLO = Slo(ttft_s=0.5, itl_s=0.1)


class FakeTarget:
    """Streams ``output_len`` tokens after ``ttft_s``, one every ``itl_s``; records what it saw."""

    def __init__(self, ttft_s: float = 0.005, itl_s: float = 0.001, report_ids: bool = True,
                 fail_ids: tuple[str, ...] = (), raise_ids: tuple[str, ...] = ()):
        self.origin_s = time.perf_counter()
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.report_ids = report_ids
        self.fail_ids, self.raise_ids = fail_ids, raise_ids
        self.in_flight = 0
        self.max_in_flight = 0
        self.in_flight_at_send: list[int] = []
        self.sent: list[tuple[float, BenchRequest]] = []

    def now(self) -> float:
        return time.perf_counter() - self.origin_s

    async def send(self, request: BenchRequest) -> StreamedResult:
        arrival = self.now()
        self.sent.append((arrival, request))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.in_flight_at_send.append(self.in_flight)
        try:
            if request.request_id in self.raise_ids:
                raise RuntimeError("target bug")
            await asyncio.sleep(self.ttft_s)
            times = []
            for i in range(request.output_len):
                if i:
                    await asyncio.sleep(self.itl_s)
                times.append(self.now())
            ok = request.request_id not in self.fail_ids
            ids = [1000 + len(request.prompt_token_ids) + i for i in range(request.output_len)]
            return StreamedResult(request.request_id, request.session_id, request.round_index, arrival, times[0],
                                  times, self.now(), request.prompt_len, request.output_len, ok,
                                  None if ok else "boom", output_token_ids=ids if self.report_ids else [])
        finally:
            self.in_flight -= 1


def _requests(n: int, prompt_len: int = 4, output_len: int = 3) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", list(range(i, i + prompt_len)), output_len) for i in range(n)]


def _run(target, items, arrival=None, **kwargs):
    return asyncio.run(run_benchmark(target, items, arrival, **kwargs))


def test_arrivals_are_honoured_in_order_without_drift():
    target = FakeTarget()
    offsets = [i * 0.004 for i in range(40)]
    results = _run(target, _requests(40), offsets)
    assert [r.request_id for _, r in target.sent] == [f"r{i}" for i in range(40)]
    assert [r.request_id for r in results] == [f"r{i}" for i in range(40)]
    for offset, result in zip(offsets, results):
        assert offset - 1e-4 <= result.arrival_s <= offset + 0.02
    # Absolute scheduling: the last send is on time even after 39 sleeps.
    assert results[-1].arrival_s == pytest.approx(offsets[-1], abs=0.015)
    assert all(r.ok and r.output_len == 3 and len(r.token_times_s) == 3 for r in results)


def test_arrival_process_offsets_are_used():
    target = FakeTarget()
    results = _run(target, _requests(5), constant(50.0))
    assert [round(r.arrival_s, 2) for r in results] == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08], abs=0.011)


def test_max_concurrency_is_never_exceeded():
    target = FakeTarget(ttft_s=0.01)
    results = _run(target, _requests(20), None, max_concurrency=3)
    assert len(results) == 20 and all(r.ok for r in results)
    assert target.max_in_flight == 3


def test_closed_loop_concurrency_is_exact():
    target = FakeTarget(ttft_s=0.01)
    results = _run(target, _requests(16), None, concurrency=4)
    assert len(results) == 16
    assert target.max_in_flight == 4
    # Every send but the first three joins exactly three others: workers refill at once.
    assert target.in_flight_at_send[3:] == [4] * 13
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(16))


def _session(sid: str, rounds: int, delay_s: float) -> SessionPlan:
    return SessionPlan(sid, [PlannedRound([50 + 10 * k + j for j in range(5)], 2, 0.0 if k == 0 else delay_s,
                                          [7, 7]) for k in range(rounds)])


@pytest.mark.parametrize("report_ids", [True, False])
def test_session_rounds_are_sequential_and_history_grows(report_ids):
    target = FakeTarget(report_ids=report_ids)
    plans = [_session("s0", 3, 0.02), _session("s1", 3, 0.02)]
    results = _run(target, plans, [0.0, 0.005])
    assert len(results) == 6
    for plan in plans:
        rounds = sorted((r for r in results if r.session_id == plan.session_id), key=lambda r: r.round_index)
        assert [r.round_index for r in rounds] == [0, 1, 2]
        sent = [req for _, req in target.sent if req.session_id == plan.session_id]
        history: list[int] = []
        for k, (req, res) in enumerate(zip(sent, rounds)):
            assert req.round_index == k
            assert req.prompt_token_ids == history + plan.rounds[k].incr_prompt_ids
            assert res.prompt_len == len(req.prompt_token_ids)
            if k:
                # The tool delay runs after the previous round's last token.
                assert res.arrival_s >= rounds[k - 1].end_s + 0.02 - 1e-3
            outputs = [1000 + req.prompt_len + i for i in range(2)] if report_ids else [7, 7]
            history = req.prompt_token_ids + outputs
    summary = summarize(results, SLO)
    assert summary.ttft_initial.count == 2 and summary.ttft_incremental.count == 4


def test_failed_round_ends_its_session():
    target = FakeTarget(fail_ids=("s0/r1",))
    results = _run(target, [_session("s0", 3, 0.0)], None)
    assert [(r.round_index, r.ok) for r in results] == [(0, True), (1, False)]


def test_duration_limit_stops_the_run():
    target = FakeTarget(ttft_s=0.15)
    start = time.perf_counter()
    results = _run(target, _requests(100), [i * 0.05 for i in range(100)], duration_limit_s=0.2)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5
    assert 3 <= len(results) <= 6
    assert all(r.arrival_s <= 0.2 + 0.02 for r in results)
    assert results[0].ok
    cut = [r for r in results if not r.ok]
    assert cut and all(r.error == CUT_OFF for r in cut)


def test_duration_limit_stops_sessions_and_closed_loop():
    target = FakeTarget(ttft_s=0.03)
    results = _run(target, [_session(f"s{i}", 5, 0.05) for i in range(4)], None, duration_limit_s=0.15,
                   concurrency=2)
    assert results and all(r.arrival_s <= 0.17 for r in results)
    assert len(results) < 20


def test_a_raising_target_becomes_a_failed_result():
    target = FakeTarget(raise_ids=("r1",))
    results = _run(target, _requests(3), None)
    by_id = {r.request_id: r for r in results}
    assert not by_id["r1"].ok and "target bug" in by_id["r1"].error
    assert by_id["r0"].ok and by_id["r2"].ok


def test_progress_callback_sees_every_request():
    target = FakeTarget()
    seen = []
    _run(target, _requests(5), None, progress=lambda s: seen.append((s.sent, s.done, s.errors, s.in_flight)))
    assert seen[0] == (0, 0, 0, 0)
    assert seen[-1] == (5, 5, 0, 0)
    assert max(in_flight for *_, in_flight in seen) >= 1


def test_report_files_are_written(tmp_path):
    target = FakeTarget(fail_ids=("r3",))
    results = _run(target, _requests(8), [i * 0.002 for i in range(8)])
    summary = summarize(results, SLO)
    record = run_record(summary, {"note": "unit"}, results)
    json_path = write_json(tmp_path / "bench.json", record)
    csv_path = write_csv(tmp_path / "bench.csv", results, SLO)
    pngs = [plot_latency_cdfs(results, SLO, tmp_path / "cdf.png"), plot_timeline(results, SLO, tmp_path / "tl.png"),
            plot_attainment_vs_rate([{"rate": 1.0, "attainment": 1.0, "goodput_tokens_per_s": 5.0},
                                     {"rate": 2.0, "attainment": 0.5, "goodput_tokens_per_s": 6.0}],
                                    tmp_path / "avr.png", 0.9)]

    data = json.loads(json_path.read_text())
    assert data["summary"]["n_requests"] == 8 and data["summary"]["n_ok"] == 7
    assert data["config"] == {"note": "unit"} and "python" in data["machine"]
    assert len(data["requests"]) == 8 and len(data["requests"][0]["token_times_s"]) == 3
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 8 and {r["ok"] for r in rows} == {"True", "False"}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    faster = dict(data)
    faster["summary"] = {**data["summary"], "request_throughput": data["summary"]["request_throughput"] * 2}
    b_path = write_json(tmp_path / "b.json", faster)
    _, compared = compare(json_path, b_path)
    ratios = {row["metric"]: row["ratio"] for row in compared}
    assert ratios["request throughput /s"] == pytest.approx(2.0)
    assert ratios["TTFT p50 s"] == pytest.approx(1.0)


def test_history_uses_filler_when_ids_are_missing_and_run_is_reproducible():
    from loadgen.plan import plan_sessions
    from loadgen.sessions import generate_sessions

    sessions = generate_sessions("hotpotqa", 2, np.random.default_rng(0), length_scale=0.01)
    a = plan_sessions(sessions, np.random.default_rng(1), 256, "x")
    b = plan_sessions(sessions, np.random.default_rng(1), 256, "y")
    assert [r.incr_prompt_ids for r in a[0].rounds] == [r.incr_prompt_ids for r in b[0].rounds]
    assert a[0].session_id != b[0].session_id
    assert all(len(r.filler_output_ids) == r.output_len for p in a for r in p.rounds)
