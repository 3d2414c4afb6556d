"""Baseline placement policies on the simulator: goodput, p99 TBT, SLO attainment and capacity.

Cluster: 8 workers of H100 x Llama-3-8B (roofline preset, TP1, 25,720 KV blocks of 16
tokens each), local batch policy fcfs with a 2,048-token step budget (chunked prefill)
and up to 256 running requests. Policies:

* round_robin, least_loaded: all 8 workers colocated (role "both");
* pd_disaggregated: 4 prefill + 4 decode workers, the 1:1 split of DynaServe's PD
  Disagg. baseline (1P+1D on two GPUs, arXiv 2504.09285 §3), KV pushed over a 400 Gb/s
  RDMA NIC per GPU in 64-token chunks.

Workloads: DynaServe's three request shapes (P8192/D32, P2048/D512, P219/D1467, with
Poisson arrivals) and the Azure LLM inference 2023 code and conversation traces (real
lengths, the trace's own arrival pattern rescaled to each rate). Every run offers 60 s of
arrivals (at least 200 requests) and is simulated until the last request finishes, so an
overloaded rate shows as growing queues rather than a transient the cluster absorbs.

SLOs: p99 TBT (every request's own p99 inter-token gap) <= 100 ms, DynaServe's SLO
(§6.1, after DistServe); TTFT <= 1 s, or <= 5 s for the 8,192-token prompts (about 20x
their 0.27 s isolated prefill, so that limit binds only under queueing); and no single gap
longer than the TTFT limit (`Slo.max_gap_s`): after a disaggregated prefill the wait for
a decode slot is one gap among hundreds, which the p99 alone never sees, so without it a
saturated decode pool would pass at any rate. Capacity is `loadgen.metrics.find_capacity`
at 90% SLO attainment (DynaServe's serving capacity, with our attainment target), never
probing above 4x the perf-model estimate it starts from (`--max-rate-factor`). Goodput, attainment and tail latencies are reported at one
stated rate per workload: the median of the three policies' capacities (2 significant
digits), where the policies differ most.

    .venv/bin/python benchmarks/baselines_sim.py --out bench-results/baselines_sim.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadgen import arrivals  # noqa: E402
from loadgen.bench_config import arrival_at_rate  # noqa: E402
from loadgen.metrics import Slo, find_capacity, summarize  # noqa: E402
from loadgen.traces import TraceRequest, read_trace  # noqa: E402
from loadgen.workloads import DYNASERVE_SHAPES, RequestShape  # noqa: E402
from services.planner.sim_workload import requests_from_shapes, requests_from_trace  # noqa: E402
from services.planner.sim_run import STALLED  # noqa: E402
from services.planner.simulator import Simulator, pd_roles  # noqa: E402

console = Console(width=170)  # tables stay readable when piped to a file
TRACES = REPO.parent / "shared" / "traces"
WORKERS = 8
TARGET_ATTAINMENT = 0.9
SLO = Slo(ttft_s=1.0, itl_s=0.1, max_gap_s=1.0)
# Every prompt here is unique (random shapes, traces without prefix ids), so the prefix cache
# can never hit: it is off, which changes no timing and saves the engine's block re-indexing.
COMMON = {"enable_prefix_caching": False}
POLICIES: dict[str, dict[str, Any]] = {
    "round_robin": {"placement_policy": "round_robin", **COMMON},
    "least_loaded": {"placement_policy": "least_loaded", **COMMON},
    "pd_disaggregated": {"placement_policy": "pd_disaggregated", "roles": pd_roles(WORKERS, WORKERS // 2), **COMMON},
}


@dataclass
class Workload:
    """One row group: request lengths, how they arrive, and the SLO."""

    name: str
    slo: Slo
    shape: RequestShape | None = None
    rows: list[TraceRequest] | None = None  # a trace: its lengths, and its arrivals rescaled to each rate

    def run_inputs(self, rate: float, window_s: float, min_requests: int) -> tuple[list, Any]:
        """Items and arrival process for `window_s` seconds of arrivals at `rate` (at least `min_requests`)."""
        n = max(min_requests, math.ceil(rate * window_s))
        if self.shape is not None:
            return requests_from_shapes([self.shape], n), arrivals.poisson(rate)
        rows = self.rows[:n]
        return requests_from_trace(rows), arrival_at_rate(arrivals.trace([r.arrival_s for r in rows]), rate)

    def mean_lengths(self) -> tuple[float, float]:
        if self.shape is not None:
            return self.shape.prompt_len, self.shape.output_len
        return (sum(r.prompt_len for r in self.rows) / len(self.rows),
                sum(r.output_len for r in self.rows) / len(self.rows))


def workloads() -> list[Workload]:
    """DynaServe's shapes and the two Azure traces."""
    long_prompt, balanced, long_decode = DYNASERVE_SHAPES
    return [
        Workload(str(long_prompt), Slo(5.0, 0.1, max_gap_s=5.0), shape=long_prompt),
        Workload(str(balanced), SLO, shape=balanced),
        Workload(str(long_decode), SLO, shape=long_decode),
        Workload("Azure code", SLO, rows=read_trace(TRACES / "AzureLLMInferenceTrace_code.csv")),
        Workload("Azure conversation", SLO, rows=read_trace(TRACES / "AzureLLMInferenceTrace_conv.csv")),
    ]


def rough_capacity(sim: Simulator, workload: Workload, policy: str) -> float:
    """Requests/s the cluster sustains by the perf model alone (prefill and decode time-shared on a
    worker, or split over the pd pools): only where the capacity search starts looking."""
    model, config = sim.config.perf_model, sim.config
    prompt, output = workload.mean_lengths()
    prefill_s = model.prefill_time(0, round(prompt))
    batch = max(1, min(config.max_num_seqs, config.num_kv_blocks * config.block_size // round(prompt + output / 2)))
    decode_s = output * model.decode_time(batch, prompt + output / 2) / batch
    if policy == "pd_disaggregated":
        return WORKERS / 2 * min(1 / prefill_s, 1 / decode_s)
    return WORKERS / (prefill_s + decode_s)


def evaluate(workload: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every policy's capacity, then every policy at the stated rate: the median of the capacities."""
    sims = {policy: Simulator.from_preset(WORKERS, "H100", "Llama-3-8B", **options)
            for policy, options in POLICIES.items()}

    def summary_at(policy: str, rate: float):
        items, arrival = workload.run_inputs(rate, args.window_s, args.min_requests)
        results = sims[policy].run(items, arrival, seed=args.seed).results
        stalled = sum(r.error == STALLED for r in results)
        if stalled:  # a deadlock in the engine or simulator, not overload: never a data point
            raise RuntimeError(f"{workload.name} / {policy} at {rate:g} req/s: {stalled} requests stalled")
        return summarize(results, workload.slo)

    rows = []
    for policy, sim in sims.items():
        started = time.perf_counter()
        guess = rough_capacity(sim, workload, policy)
        capacity = find_capacity(lambda rate, p=policy: summary_at(p, rate).slo_attainment, TARGET_ATTAINMENT,
                                 lo=0.5 * guess, hi=guess, tol=args.rate_tol * guess, max_iters=args.max_probes,
                                 max_rate=args.max_rate_factor * guess)
        rows.append({"workload": workload.name, "policy": policy, "capacity_rps": capacity.rate,
                     "capacity": capacity.to_dict(), "capacity_search_start": guess,
                     "wall_s": time.perf_counter() - started})
    stated_rate = float(f"{statistics.median(r['capacity_rps'] for r in rows):.2g}")
    for row in rows:
        started = time.perf_counter()
        stated = summary_at(row["policy"], stated_rate)
        row.update({
            "stated_rate": stated_rate, "goodput_tokens_per_s": stated.goodput_tokens_per_s,
            "slo_attainment": stated.slo_attainment, "itl_p99_s": stated.itl.p99,
            "tbt_p99_p99_s": stated.tbt_p99.p99, "ttft_p99_s": stated.ttft.p99, "summary": stated.to_dict(),
            "wall_s": row["wall_s"] + time.perf_counter() - started,
            "slo": {"ttft_s": workload.slo.ttft_s, "tbt_p99_s": workload.slo.itl_s,
                    "max_gap_s": workload.slo.max_gap_s},
        })
        console.print(f"{workload.name} / {row['policy']}: capacity {row['capacity_rps']:.3g} req/s, "
                      f"attainment {row['slo_attainment']:.1%} at {stated_rate:g} req/s ({row['wall_s']:.1f} s wall)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--min-requests", type=int, default=200, help="fewest requests per run")
    ap.add_argument("--rate-tol", type=float, default=0.04, help="capacity bracket width, relative to the start")
    ap.add_argument("--max-probes", type=int, default=9, help="most runs per capacity search")
    ap.add_argument("--max-rate-factor", type=float, default=4.0, help="capacity search: never probe above this "
                    "multiple of the perf-model estimate it starts from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="", help="comma list of workload names to run (default: all), "
                    "e.g. 'P219/D1467,Azure code'")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "baselines_sim.json")
    args = ap.parse_args()

    chosen = [w for w in workloads() if not args.workloads or w.name in args.workloads.split(",")]
    if not chosen:
        ap.error(f"--workloads: none of {args.workloads!r} is one of {[w.name for w in workloads()]}")
    rows: list[dict[str, Any]] = []
    for workload in chosen:
        rows += evaluate(workload, args)
        _write(args, rows)  # after every workload: a long run killed midway keeps what it measured
    results = _write(args, rows)
    _report(results)
    console.print(f"wrote {args.out}")


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "cluster": {"workers": WORKERS, "preset": "H100 x Llama-3-8B, TP1, bf16, rdma-400g",
                    "batch_policy": "fcfs", "max_num_batched_tokens": 2048, "max_num_seqs": 256,
                    "pd_disaggregated_roles": list(POLICIES["pd_disaggregated"]["roles"])},
        "target_attainment": TARGET_ATTAINMENT, "arrival_window_s": args.window_s,
        "min_requests": args.min_requests, "max_probes": args.max_probes, "rate_tol": args.rate_tol,
        "max_rate_factor": args.max_rate_factor,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=lambda v: None) + "\n")
    return results


def _report(results: dict[str, Any]) -> None:
    table = Table(title=f"baselines on {results['cluster']['workers']} simulated "
                        f"{results['cluster']['preset']} workers", header_style="bold")
    for col in ("workload", "SLO TTFT / TBT p99", "policy", "rate /s", "goodput tok/s", "attainment",
                "TTFT p99 s", "p99 TBT ms", f"capacity @{results['target_attainment']:.0%} /s"):
        table.add_column(col, justify="left" if col in ("workload", "policy", "SLO TTFT / TBT p99") else "right")
    for r in results["rows"]:
        table.add_row(r["workload"], f"{r['slo']['ttft_s']:g} s / {r['slo']['tbt_p99_s'] * 1000:g} ms", r["policy"],
                      f"{r['stated_rate']:g}", f"{r['goodput_tokens_per_s']:,.0f}", f"{r['slo_attainment']:.1%}",
                      f"{r['ttft_p99_s']:.2f}", f"{r['itl_p99_s'] * 1000:.1f}",
                      f"≥ {r['capacity_rps']:g} (capped)" if r["capacity"].get("capped") else f"{r['capacity_rps']:g}")
    console.print(table)


if __name__ == "__main__":
    main()
