"""Wall time of one DynaServe placement decision, in steady state, at 2 to 128 workers.

The issue's target: decision time p99 <= 1 ms at 64 workers (the paper's C++ scheduler
takes 13.7-17.5 ms per request, §5). What is timed is `DynaServePolicy.place` as the
scheduler calls it: sync of the timelines with the view, the choice of the candidate
workers, the probes of every candidate pair (bounded binary search over phi), the commit.

The cluster is a closed loop in virtual time, built the way the scheduler builds it:

* requests arrive as a Poisson process at `--load` x the cluster's capacity (capacity:
  requests per second one worker drains when given `--calibration-batch` requests at
  once, under the same performance model), with shapes from `--workload`: `fixed`
  (P2048/D512), `lognormal` (prompt median 1024, output median 128, sigma 1, clipped), or
  `azure` (prompt/output pairs of the Azure 2023 conversation trace, when it is there);
* the workers are shadow timelines (`WorkerTimeline`, the policy's own execution
  predictor) into which every placed stage is committed with the request's *true*
  output length (the policy predicts it: no hint, its length model learns online);
  a request completes when its last stage's passes are over, and is reported back
  (`on_completion`) with its true lengths;
* every `--refresh-ms` (the scheduler's default refresh interval) the load snapshots are
  taken from the shadow workers (running, waiting, queued prefill tokens, KV blocks held:
  consistent with what was placed) and the `ClusterView` is rebuilt by the scheduler's
  `build_cluster_view` with its `InflightCounters` (placements since the snapshot).

Each case first warms up (`--warmup-per-worker` x workers requests, untimed), then
times `--requests` decisions with `time.perf_counter_ns` (garbage collection left on, as
in the server). Reported per case: p50/p90/p99/max decision time (µs), probes per
decision, the timelines' lengths (segments, placed micro-requests) and requests in
flight per worker; the median of each over `--repeat` runs (the cases interleaved).
Reference: round_robin, least_loaded and pd_disaggregated (half prefill, half decode
workers) under the same loop.

    .venv/bin/python benchmarks/dynaserve_decision_time.py --out-dir bench-results
    .venv/bin/python benchmarks/dynaserve_decision_time.py --workers 64 --candidates 2 --references '' \\
        --extra-workloads '' --repeat 1 --profile bench-results/dynaserve_place.prof
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common import REPO, percentile_floor_rank

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from services.global_scheduler.cluster_view import InflightCounters, build_cluster_view  # noqa: E402
from services.global_scheduler.dynaserve import DEFAULT_PERF_MODEL  # noqa: E402
from services.global_scheduler.policy import (ClusterView, CompletionReport, Placement,  # noqa: E402
                                              PlacementRequest, WorkerView, learns_from_completions, make_policy)
from services.global_scheduler.timeline import MicroRequest, WorkerTimeline  # noqa: E402
from splitserve.perf.store import resolve_perf_model  # noqa: E402
from splitserve.core.records import WorkerInfo, WorkerLoad  # noqa: E402

console = Console(width=160)
AZURE_CONV = REPO.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
TARGET_P99_US = 1000.0  # the bound at 64 workers
PAPER_MS = (13.7, 17.5)  # DynaServe §5: the C++ scheduler's overhead per request
BLOCK_SIZE = 16
ENGINE_KIND = "shadow"


# ---- workloads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    prompt: int
    output: int  # the true output length (what the request generates)
    max_tokens: int


def make_shapes(workload: str, n: int, rng: np.random.Generator, max_tokens: int = 2048) -> list[Shape]:
    """`n` request shapes of the named workload (reproducible from `rng`)."""
    if workload == "fixed":
        return [Shape(2048, 512, max(512, max_tokens))] * n
    if workload == "lognormal":
        prompts = np.clip(rng.lognormal(math.log(1024), 1.0, n), 16, 8192).astype(int)
        outputs = np.clip(rng.lognormal(math.log(128), 1.0, n), 1, max_tokens).astype(int)
        return [Shape(int(p), int(d), max_tokens) for p, d in zip(prompts, outputs)]
    if workload == "azure":
        from loadgen.traces import read_trace

        rows = [r for r in read_trace(AZURE_CONV) if r.prompt_len > 0 and r.output_len > 0]
        picks = rng.integers(0, len(rows), n)
        return [Shape(rows[i].prompt_len, min(rows[i].output_len, max_tokens), max_tokens) for i in picks]
    raise ValueError(f"unknown workload {workload!r}: fixed, lognormal or azure")


def worker_capacity(perf, shapes: list[Shape], batch: int, token_budget: int) -> float:
    """Requests per second one worker drains when handed `batch` of these shapes at once."""
    timeline = WorkerTimeline(perf, token_budget, 0.0)
    for i, s in enumerate(shapes[:batch]):
        timeline.commit(MicroRequest(f"c{i}", s.prompt, 0, s.output))
    return min(batch, len(shapes)) / timeline.drain_time


# ---- the shadow cluster ------------------------------------------------------------------------------
def stage_work(placement: Placement, prompt: int, output: int) -> list[tuple[str, int, int, int]]:
    """(worker id, prefill, history, samples) of each stage that does work.

    As the policy counts it: a stage [a, b) prefills the prompt tokens in it (on the a tokens
    of KV before it) and samples one token per position p in [a, b) with P - 1 <= p <
    P + output - 1 (the last prompt position samples the first output token; the request
    stops after `output` tokens, so a stage past its end does nothing)."""
    out = []
    for stage in placement.stages:
        prefill = max(0, min(stage.end, prompt) - stage.start)
        samples = max(0, min(stage.end, prompt + output - 1) - max(stage.start, prompt - 1))
        if prefill + samples:
            out.append((stage.worker_id, prefill, stage.start, samples))
    return out


@dataclass
class ShadowWorker:
    info: WorkerInfo
    timeline: WorkerTimeline
    keys: set[str] = field(default_factory=set)


class ShadowCluster:
    """The workers: timelines running what was placed, with the requests' true lengths."""

    def __init__(self, perf, workers: int, roles: list[str], token_budget: int, kv_blocks: int,
                 kv_chunk_tokens: int = 64):
        self.perf, self.kv_blocks, self.kv_chunk_tokens = perf, kv_blocks, kv_chunk_tokens
        self.workers = {f"w{i:03d}": ShadowWorker(WorkerInfo(f"w{i:03d}", f"shadow://w{i:03d}", role=roles[i],
                                                             engine_kind=ENGINE_KIND, started_unix=0.0),
                                                  WorkerTimeline(perf, token_budget, 0.0))
                        for i in range(workers)}
        self.requests: dict[str, tuple[PlacementRequest, int, list[tuple[str, str]]]] = {}
        self.done_keys: set[str] = set()

    def run(self, request: PlacementRequest, output: int, placement: Placement) -> None:
        """Commit what each stage really does; a later stage starts after the KV reaches it."""
        placed, not_before = [], None
        for worker_id, prefill, history, samples in stage_work(placement, request.prompt_len, output):
            shadow = self.workers[worker_id]
            key = f"{request.request_id}/{len(placed)}"
            prediction = shadow.timeline.commit(MicroRequest(key, prefill, history, samples), not_before)
            shadow.keys.add(key)
            placed.append((worker_id, key))
            handoff = self.perf.kv_transfer_time(min(history + prefill + samples, self.kv_chunk_tokens))
            not_before = prediction.finish_time + handoff
        self.requests[request.request_id] = (request, output, placed)

    def advance(self, now: float) -> list[CompletionReport]:
        """Time passes; the requests whose every stage is over, as completion reports."""
        for shadow in self.workers.values():
            shadow.timeline.advance(now)
            if len(shadow.keys) != len(shadow.timeline.placed):
                gone = shadow.keys - shadow.timeline.placed.keys()
                shadow.keys -= gone
                self.done_keys |= gone
        reports = []
        for request_id, (request, output, placed) in list(self.requests.items()):
            if all(key in self.done_keys for _, key in placed):
                self.done_keys.difference_update(key for _, key in placed)
                del self.requests[request_id]
                reports.append(CompletionReport(request_id, "stop", prompt_tokens=request.prompt_len,
                                                output_tokens=output,
                                                worker_ids=tuple(w for w, _ in placed)))
        return reports

    def load(self, worker_id: str, taken_at: float) -> WorkerLoad:
        """The worker's load snapshot, from what its timeline runs (consistent with what was placed)."""
        shadow = self.workers[worker_id]
        timeline = shadow.timeline
        now_pass = timeline.origin_pass
        running = waiting = queued = used = 0
        for placed in timeline.placed.values():
            r, p = placed.request, placed.prediction
            if p.first_pass < now_pass:
                running += 1
                used += r.history + r.prefill + max(0, now_pass - p.decode_from)
            else:
                waiting += 1
                queued += r.prefill
        used_blocks = min(self.kv_blocks, -(-used // BLOCK_SIZE))
        return WorkerLoad(worker_id=worker_id, role=shadow.info.role, engine_kind=ENGINE_KIND,
                          free_blocks=self.kv_blocks - used_blocks, total_blocks=self.kv_blocks,
                          block_size=BLOCK_SIZE, running=running, waiting=waiting, queued_prefill_tokens=queued,
                          updated_unix=taken_at)

    def in_flight(self) -> int:
        return len(self.requests)


class ViewSource:
    """The scheduler's view: snapshots every `refresh_s`, plus the placements since (inflight)."""

    def __init__(self, cluster: ShadowCluster, refresh_s: float):
        self.cluster, self.refresh_s = cluster, refresh_s
        self.inflight = InflightCounters()
        self.view: ClusterView | None = None
        self.tick = -1
        self._position: dict[str, int] = {}

    def refresh(self, tick: int) -> ClusterView:
        taken_at = tick * self.refresh_s
        loads = {wid: self.cluster.load(wid, taken_at) for wid in self.cluster.workers}
        self.inflight.observe_snapshots(loads)
        self.view = build_cluster_view([s.info for s in self.cluster.workers.values()], loads, taken_at,
                                       self.inflight.counts())
        self._position = {w.worker_id: i for i, w in enumerate(self.view.workers)}
        self.tick = tick
        return self.view

    def note_placed(self, worker_ids: tuple[str, ...]) -> None:
        self.inflight.note_placed(worker_ids)
        counts, views = self.inflight.counts(), list(self.view.workers)
        for worker_id in set(worker_ids):
            i = self._position[worker_id]
            v = views[i]
            views[i] = WorkerView(v.worker_id, v.address, v.load, counts.get(worker_id, 0))
        self.view = ClusterView(tuple(views), self.view.taken_at)


# ---- one case --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    policy: str
    workers: int
    candidates: int = 2  # dynaserve's candidate_workers
    workload: str = "lognormal"

    @property
    def label(self) -> str:
        extra = f" c={self.candidates}" if self.policy == "dynaserve" else ""
        return f"{self.policy}{extra} {self.workers}w {self.workload}"


@dataclass
class CaseResult:
    case: Case
    decisions: int
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    mean_us: float
    probes_mean: float
    probes_p99: float
    pairs: int
    segments_mean: float  # per timeline (the policy's), sampled over the timed decisions
    segments_max: int
    placed_mean: float  # micro-requests per timeline
    in_flight_per_worker_start: float
    in_flight_per_worker_end: float
    arrival_rate: float  # requests/s over the cluster
    split_share: float  # decisions with two stages
    virtual_s: float
    wall_s: float
    times_us: list[float] = field(default_factory=list, repr=False)


def run_case(case: Case, *, perf, requests: int, warmup_per_worker: int, load: float, refresh_s: float,
             token_budget: int, calibration_batch: int, kv_blocks: int, seed: int,
             profile: cProfile.Profile | None = None) -> CaseResult:
    """Warm the loop up, then time `requests` decisions of `case.policy`."""
    rng = np.random.default_rng(seed)
    warmup = warmup_per_worker * case.workers
    total = warmup + requests
    shapes = make_shapes(case.workload, total, rng)
    capacity = worker_capacity(perf, make_shapes(case.workload, calibration_batch, np.random.default_rng(seed + 1)),
                               calibration_batch, token_budget)
    rate = load * capacity * case.workers
    arrivals = np.cumsum(rng.exponential(1.0 / rate, total))
    if case.policy == "pd_disaggregated":
        roles = ["prefill" if i < max(1, case.workers // 2) else "decode" for i in range(case.workers)]
    else:
        roles = ["both"] * case.workers
    params = {"candidate_workers": case.candidates, "token_budget": token_budget} \
        if case.policy == "dynaserve" else {}
    policy = make_policy(case.policy, deployment_perf_model=perf, **params)
    feedback = learns_from_completions(policy)
    cluster = ShadowCluster(perf, case.workers, roles, token_budget, kv_blocks)
    source = ViewSource(cluster, refresh_s)
    times, probes, segments, placed_counts = [], [], [], []
    splits = 0
    in_flight_start = 0.0
    started = time.perf_counter()
    for index, (shape, now) in enumerate(zip(shapes, arrivals)):
        now = float(now)
        tick = int(now / refresh_s)
        if tick != source.tick:  # a refresh instant passed: time moves on, completions come back
            for report in cluster.advance(tick * refresh_s):
                if feedback:
                    policy.on_completion(report)
            source.refresh(tick)
        request = PlacementRequest(f"r{index}", shape.prompt, shape.max_tokens)
        timed = index >= warmup
        if timed and index == warmup:
            in_flight_start = cluster.in_flight() / case.workers
        if timed and profile is not None:
            profile.enable()
        t0 = time.perf_counter_ns()
        placement = policy.place(request, source.view, now)
        elapsed = time.perf_counter_ns() - t0
        if timed and profile is not None:
            profile.disable()
        cluster.run(request, shape.output, placement)
        source.note_placed(placement.worker_ids)
        if timed:
            times.append(elapsed / 1000)
            splits += len(placement.stages) > 1
            if "probes" in placement.decision:
                probes.append(placement.decision["probes"])
            if (index - warmup) % 16 == 0 and getattr(policy, "timelines", None):
                segments.extend(len(t.segments) for t in policy.timelines.values())
                placed_counts.extend(len(t.placed) for t in policy.timelines.values())
    wall = time.perf_counter() - started
    ordered = sorted(times)

    pool = min(case.candidates, case.workers)
    return CaseResult(case, len(times), percentile_floor_rank(ordered, 50), percentile_floor_rank(ordered, 90),
                      percentile_floor_rank(ordered, 99), ordered[-1], statistics.fmean(times),
                      statistics.fmean(probes) if probes else 0.0,
                      float(np.percentile(probes, 99)) if probes else 0.0,
                      pool * (pool - 1) // 2 if case.policy == "dynaserve" else 0,
                      statistics.fmean(segments) if segments else 0.0, max(segments, default=0),
                      statistics.fmean(placed_counts) if placed_counts else 0.0,
                      in_flight_start, cluster.in_flight() / case.workers, rate, splits / max(1, len(times)),
                      float(arrivals[-1]), wall, times)


# ---- reporting ----------------------------------------------------------------------------------------
MEDIANED = ("p50_us", "p90_us", "p99_us", "max_us", "mean_us", "probes_mean", "probes_p99", "segments_mean",
            "segments_max", "placed_mean", "in_flight_per_worker_start", "in_flight_per_worker_end", "split_share",
            "wall_s")


def summarize(runs: list[CaseResult]) -> dict:
    """The median of each figure over the repeats of one case."""
    first = runs[0]
    out = {"case": asdict(first.case), "label": first.case.label, "repeats": len(runs),
           "decisions_per_repeat": first.decisions, "pairs": first.pairs,
           "arrival_rate_per_s": round(first.arrival_rate, 2), "virtual_s": round(first.virtual_s, 2)}
    for name in MEDIANED:
        out[name] = round(statistics.median(getattr(r, name) for r in runs), 3)
    out["p99_us_each_repeat"] = [round(r.p99_us, 1) for r in runs]
    return out


def print_table(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for column in ("case", "p50 µs", "p90 µs", "p99 µs", "max µs", "probes", "pairs", "segments/tl",
                   "max seg", "placed/tl", "in flight/w", "split", "req/s"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for r in rows:
        table.add_row(r["label"], f"{r['p50_us']:.0f}", f"{r['p90_us']:.0f}", f"{r['p99_us']:.0f}",
                      f"{r['max_us']:.0f}", f"{r['probes_mean']:.1f}", str(r["pairs"]), f"{r['segments_mean']:.1f}",
                      f"{r['segments_max']:.0f}", f"{r['placed_mean']:.1f}",
                      f"{r['in_flight_per_worker_start']:.1f}→{r['in_flight_per_worker_end']:.1f}",
                      f"{r['split_share']:.0%}", f"{r['arrival_rate_per_s']:.0f}")
    console.print(table)


def plot(path: Path, sweep: list[dict], focus: list[dict], cdfs: dict[str, list[float]], focus_workers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6))
    xs = [r["case"]["workers"] for r in sweep]
    for name, style in (("p50_us", "o-"), ("p90_us", "s--"), ("p99_us", "^-")):
        left.plot(xs, [r[name] / 1000 for r in sweep], style, label=f"dynaserve {name[:3]}")
    for r in focus:
        if r["case"]["policy"] != "dynaserve":
            left.plot([r["case"]["workers"]], [r["p99_us"] / 1000], "x", markersize=9, label=f"{r['label']} p99")
    left.axhline(TARGET_P99_US / 1000, color="red", linewidth=0.8, label="target p99 (1 ms)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("workers")
    left.set_ylabel("decision time (ms)")
    left.set_title("DynaServePolicy.place, steady state")
    left.legend(fontsize=7)
    for label, times in cdfs.items():
        ordered = sorted(times)
        right.plot([t / 1000 for t in ordered], [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    right.axvline(TARGET_P99_US / 1000, color="red", linewidth=0.8)
    right.axhline(0.99, color="grey", linewidth=0.5)
    right.set_xscale("log")
    right.set_xlabel("decision time (ms)")
    right.set_ylabel("share of decisions")
    right.set_title(f"{focus_workers} workers (one repeat)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "processor": platform.processor(),
            "cpus": os.cpu_count()}
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                                 if line.startswith("model name"))
        info["loadavg_at_start"] = os.getloadavg()
    except (OSError, StopIteration):
        pass
    return info


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workers", default="2,8,16,32,64,128", help="worker counts of the dynaserve sweep")
    parser.add_argument("--focus-workers", type=int, default=64,
                        help="worker count of the candidate_workers sensitivity and the references")
    parser.add_argument("--candidates", default="2,4,8", help="dynaserve candidate_workers at --focus-workers "
                        "(the first is also the sweep's)")
    parser.add_argument("--references", default="round_robin,least_loaded,pd_disaggregated",
                        help="other policies timed at --focus-workers")
    parser.add_argument("--workload", default="lognormal", choices=("fixed", "lognormal", "azure"),
                        help="request shapes of the sweep (azure: the conversation trace in ../shared/traces)")
    parser.add_argument("--extra-workloads", default="fixed,azure",
                        help="also time dynaserve at --focus-workers on these (azure skipped if the trace is absent)")
    parser.add_argument("--requests", type=int, default=2000, help="timed decisions per case and repeat")
    parser.add_argument("--warmup-per-worker", type=int, default=48,
                        help="untimed requests per worker placed first (to reach steady state)")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the cluster's capacity")
    parser.add_argument("--calibration-batch", type=int, default=64,
                        help="capacity = requests/s a worker drains when handed this many at once")
    parser.add_argument("--refresh-ms", type=float, default=50.0, help="load snapshot interval (the scheduler's)")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per engine pass")
    parser.add_argument("--kv-blocks", type=int, default=27_000,
                        help="KV blocks of 16 tokens per worker (~H100 80 GB x Llama-3-8B)")
    parser.add_argument("--perf-model", default=DEFAULT_PERF_MODEL, help="performance model (workers and policy)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every case (medians reported)")
    parser.add_argument("--seed", type=int, default=1, help="workload and arrivals seed (the same for every repeat)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench-results",
                        help="writes dynaserve_decision_time.json and .png here")
    parser.add_argument("--profile", type=Path, help="cProfile the timed place calls of the first case (in a separate run) into this file")
    args = parser.parse_args(argv)

    try:
        perf = resolve_perf_model(args.perf_model)
    except ValueError as err:
        parser.error(str(err))
    candidates = _ints(args.candidates)
    if not candidates or min(candidates) < 2:
        parser.error("--candidates: integers >= 2")
    extra = [w for w in _names(args.extra_workloads) if w != args.workload]
    if "azure" in extra and not AZURE_CONV.exists():
        console.print(f"[yellow]{AZURE_CONV} not found: the azure workload is skipped[/]")
        extra.remove("azure")
    sweep_cases = [Case("dynaserve", n, candidates[0], args.workload) for n in _ints(args.workers)]
    focus = args.focus_workers
    focus_cases = [Case("dynaserve", focus, c, args.workload) for c in candidates]
    focus_cases += [Case("dynaserve", focus, candidates[0], w) for w in extra]
    focus_cases += [Case(name, focus, 2, args.workload) for name in _names(args.references)]
    cases = list(dict.fromkeys(sweep_cases + focus_cases))

    settings = dict(perf=perf, requests=args.requests, warmup_per_worker=args.warmup_per_worker, load=args.load,
                    refresh_s=args.refresh_ms / 1000, token_budget=args.token_budget,
                    calibration_batch=args.calibration_batch, kv_blocks=args.kv_blocks, seed=args.seed)
    if args.profile:  # a run of its own: the profiler's overhead stays out of the reported times
        profile = cProfile.Profile()
        run_case(cases[0], **settings, profile=profile)
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(args.profile)
        console.print(f"wrote {args.profile} (timed place calls of {cases[0].label}, a separate run)")
    runs: dict[Case, list[CaseResult]] = {c: [] for c in cases}
    started = time.perf_counter()
    for repeat in range(args.repeat):
        for case in cases:
            gc.collect()
            result = run_case(case, **settings)
            runs[case].append(result)
            console.print(f"repeat {repeat + 1}/{args.repeat} {case.label}: p50 {result.p50_us:.0f} µs, "
                          f"p99 {result.p99_us:.0f} µs ({result.wall_s:.1f} s)")
    elapsed = time.perf_counter() - started

    summary = {c: summarize(runs[c]) for c in cases}
    sweep_rows = [summary[c] for c in sweep_cases]
    focus_rows = [summary[c] for c in focus_cases]
    print_table(sweep_rows, f"dynaserve decision time by cluster size ({args.workload}, load {args.load:g}; "
                            f"median of {args.repeat})")
    print_table(focus_rows, f"{focus} workers: candidate_workers, workloads, reference policies")
    at_focus = summary.get(Case("dynaserve", focus, candidates[0], args.workload))
    if at_focus:
        verdict = "meets" if at_focus["p99_us"] <= TARGET_P99_US else "MISSES"
        console.print(f"dynaserve at {focus} workers: p99 {at_focus['p99_us']:.0f} µs — {verdict} the "
                      f"{TARGET_P99_US:.0f} µs target (paper's C++ scheduler: {PAPER_MS[0]}–{PAPER_MS[1]} ms)")
    console.print(f"{len(cases)} cases x {args.repeat} repeats in {elapsed:.0f} s")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "dynaserve_decision_time.json"
    report = {
        "benchmark": "dynaserve_decision_time",
        "command": " ".join([Path(sys.argv[0]).name if argv is None else "dynaserve_decision_time.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir", "profile")},
        "target_p99_us_at_64": TARGET_P99_US,
        "wall_s": round(elapsed, 1),
        "sweep": sweep_rows,
        "focus": focus_rows,
    }
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"wrote {out}")
    cdfs = {summary[c]["label"]: runs[c][0].times_us for c in focus_cases}
    png = out.with_suffix(".png")
    plot(png, sweep_rows, focus_rows, cdfs, focus)
    console.print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
