"""Simulator speed: simulated requests per wall second on an hour of the Mooncake conversation trace.

The whole trace (12,031 requests over 3,537 s, real lengths: prompts mean 12,035 / max
126,195 tokens, outputs mean 343) replayed at its own timestamps on H100 x Llama-3-8B
preset workers (TP1, 25,720 KV blocks of 16 tokens each). Each row is one full
simulation; wall time covers building the cluster (every worker's real BlockManager),
the event loop and the per-request results. The default configuration is the
simulator's default: prefix caching on, fast-forwarded decode runs; the other rows show
what each costs, and with --stepping what fast-forward saves. On a shared machine,
--repeat N runs each row N times and reports the median wall time (all N are kept in
the JSON); --only picks rows by label.

    .venv/bin/python benchmarks/simulator_speed.py --out bench-results/simulator_speed.json
    .venv/bin/python benchmarks/simulator_speed.py --only "64 workers, least_loaded" --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from common import REPO

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadgen import arrivals  # noqa: E402
from loadgen.metrics import Slo, summarize  # noqa: E402
from loadgen.traces import read_trace  # noqa: E402
from services.planner.sim_workload import PromptIds, requests_from_trace  # noqa: E402
from services.planner.simulator import Simulator, pd_roles, preset_kv_blocks  # noqa: E402
from splitserve.core import BlockManager, SamplingParams, Sequence, StageKey  # noqa: E402

console = Console(width=170)  # tables stay readable when piped to a file
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SLO = Slo(ttft_s=5.0, itl_s=0.1)  # reported only as a sanity check of what was simulated


def configurations(workers: list[int], stepping: bool) -> list[dict[str, Any]]:
    """(label, simulator options) rows: the default at every worker count, then variants at 64."""
    rows = [{"label": f"{n} workers, least_loaded", "workers": n, "options": {}} for n in workers]
    rows += [
        {"label": "64 workers, least_loaded, no prefix caching", "workers": 64,
         "options": {"enable_prefix_caching": False}},
        {"label": "64 workers, round_robin", "workers": 64, "options": {"placement_policy": "round_robin"}},
        {"label": "64 workers, pd_disaggregated 16P+48D", "workers": 64,
         "options": {"placement_policy": "pd_disaggregated", "roles": pd_roles(64, 16)}},
    ]
    if stepping:
        rows.append({"label": "64 workers, least_loaded, stepping (no fast-forward)", "workers": 64,
                     "options": {"fast_forward": False}})
    return rows


def run_row(row: dict[str, Any], items: list, arrival: Any, repeat: int = 1, perf_backend: str = "auto") -> dict[str, Any]:
    walls = []
    for _ in range(repeat):  # every repetition simulates exactly the same thing; only wall times differ
        started = time.perf_counter()
        sim = Simulator.from_preset(row["workers"], "H100", "Llama-3-8B", perf_backend=perf_backend, **row["options"])
        outcome = sim.run(items, arrival)
        walls.append(time.perf_counter() - started)
    wall = statistics.median(walls)
    summary = summarize(outcome.results, SLO)
    s = outcome.stats
    return {
        "label": row["label"], "workers": row["workers"], "perf_backend": sim.config.perf_model.backend,
        "step_times": sim.config.perf_model.timing_note,
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in row["options"].items()},
        "requests": len(outcome.results), "wall_s": wall, "wall_s_runs": walls, "event_loop_wall_s": s.wall_s,
        "setup_and_results_wall_s": walls[-1] - s.wall_s, "requests_per_wall_s": len(outcome.results) / wall,
        "virtual_s": s.virtual_s, "virtual_per_wall": s.virtual_s / wall, "engine_steps": s.steps,
        "events": s.events, "kv_transfers": s.kv_transfers, "preemptions": s.preemptions,
        "worker_busy_fraction": s.worker_busy_fraction, "n_ok": summary.n_ok,
        "ttft_p50_s": summary.ttft.p50, "ttft_p99_s": summary.ttft.p99, "itl_p99_s": summary.itl.p99,
        "slo_attainment": summary.slo_attainment,
    }


def prefix_cache_floor(items: list, workers: int, num_blocks: int, block_size: int) -> dict[str, Any]:
    """The per-block work no exact prefix-caching simulation can skip, alone: every prompt's
    token ids made, every full block hashed (the core's chained hash), inserted into its
    worker's prefix index, and popped from it once that worker holds more than its KV
    capacity. Requests go round-robin over worker-sized indexes; no scheduling, no timing,
    no reference counts, no LRU: a lower bound on the simulator's wall time on this machine
    (both run in the same process, one after the other)."""
    started = time.perf_counter()
    prompts = PromptIds()
    hasher = BlockManager(1, block_size)  # only its chained block hash is used
    indexes: list[dict[int, int]] = [{} for _ in range(workers)]
    fifos: list[deque[int]] = [deque() for _ in range(workers)]
    blocks = 0
    for n, spec in enumerate(items):
        index, fifo = indexes[n % workers], fifos[n % workers]
        tokens = prompts.for_request(spec)
        hashes = hasher.update_block_hashes(Sequence(StageKey(spec.request_id), tokens, len(tokens), SamplingParams(),
                                                     0, 0.0))
        blocks += len(hashes)
        for block_id, h in enumerate(hashes):
            index.setdefault(h, block_id)
        fifo.extend(hashes)
        while len(fifo) > num_blocks:
            index.pop(fifo.popleft(), None)
    return {"wall_s": time.perf_counter() - started, "blocks": blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--workers", default="8,64,256", help="worker counts of the default configuration")
    ap.add_argument("--stepping", action="store_true", help="also run without fast-forward (slow)")
    ap.add_argument("--only", action="append", default=[], metavar="LABEL",
                    help="run only the configuration with this label (repeatable; default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration; wall s is their median")
    ap.add_argument("--perf-backend", default="auto", help="step times: auto | aiconfigurator | roofline; a comma "
                    "list runs every row with each, alternating (A B B A ...) over --repeat")
    ap.add_argument("--no-floor", action="store_true", help="skip the prefix-cache floor measurement")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "simulator_speed.json")
    args = ap.parse_args()

    rows = read_trace(args.trace)
    items = requests_from_trace(rows)
    arrival = arrivals.trace([r.arrival_s for r in rows])
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "workload": {"trace": args.trace.name, "requests": len(rows), "span_s": rows[-1].arrival_s,
                     "prompt_tokens": sum(r.prompt_len for r in rows),
                     "output_tokens": sum(r.output_len for r in rows)},
        "preset": "H100 x Llama-3-8B, TP1, bf16, rdma-400g", "command": " ".join(sys.argv), "slo": {"ttft_s": SLO.ttft_s, "itl_s": SLO.itl_s},
        "runs": [],
    }
    rows_to_run = configurations([int(w) for w in args.workers.split(",")], args.stepping)
    if args.only:
        unknown = set(args.only) - {row["label"] for row in rows_to_run}
        if unknown:
            ap.error(f"--only: no configuration labelled {sorted(unknown)} "
                     f"(have: {[row['label'] for row in rows_to_run]})")
        rows_to_run = [row for row in rows_to_run if row["label"] in args.only]
    backends = [b.strip() for b in args.perf_backend.split(",") if b.strip()]
    for row in rows_to_run:
        if len(backends) == 1:
            runs = [run_row(row, items, arrival, max(1, args.repeat), backends[0])]
        else:  # side by side, alternating, so the machine's drift hits every backend alike
            walls: dict[str, list] = {b: [] for b in backends}
            last: dict[str, dict] = {}
            for i in range(max(1, args.repeat)):
                for b in (backends if i % 2 == 0 else backends[::-1]):
                    last[b] = run_row(row, items, arrival, 1, b)
                    walls[b].append(last[b]["wall_s"])
            runs = []
            for b in backends:
                r = last[b]
                r["wall_s_runs"], r["wall_s"] = walls[b], statistics.median(walls[b])
                r["requests_per_wall_s"] = r["requests"] / r["wall_s"]
                r["virtual_per_wall"] = r["virtual_s"] / r["wall_s"]
                runs.append(r)
        for result in runs:
            console.print(f"{result['label']} [{result['perf_backend']}]: {result['wall_s']:.1f} s wall, "
                          f"{result['requests_per_wall_s']:,.0f} requests/s")
            results["runs"].append(result)
    if not args.no_floor:
        floors = [prefix_cache_floor(items, 64, preset_kv_blocks("H100", "Llama-3-8B"), 16)
                  for _ in range(max(1, args.repeat))]
        results["floor_64_workers"] = {"wall_s": statistics.median(f["wall_s"] for f in floors),
                                       "wall_s_runs": [f["wall_s"] for f in floors], "blocks": floors[0]["blocks"]}
        console.print(f"floor (tokens, hashes, index insert and evict; 64 workers): "
                      f"{results['floor_64_workers']['wall_s']:.1f} s wall")
    for r in results["runs"]:
        if r["workers"] == 64 and not r["options"]:
            results.setdefault("one_hour_of_trace_on_64_workers_wall_s", {})[r["perf_backend"]] = \
                r["wall_s"] * 3600 / r["virtual_s"]
    _report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.out}")


def _report(results: dict[str, Any]) -> None:
    w = results["workload"]
    table = Table(title=f"simulator speed: {w['trace']} ({w['requests']:,} requests, {w['span_s']:,.0f} s), "
                        f"{results['preset']}", header_style="bold")
    for col in ("configuration", "step times", "wall s", "of which setup", "requests / wall s", "virtual / wall",
                "engine steps", "events", "TTFT p50 s", "ok"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in results["runs"]:
        table.add_row(r["label"], r["perf_backend"], f"{r['wall_s']:.1f}", f"{r['setup_and_results_wall_s']:.1f}",
                      f"{r['requests_per_wall_s']:,.0f}", f"{r['virtual_per_wall']:,.0f}x",
                      f"{r['engine_steps']:,}", f"{r['events']:,}", f"{r['ttft_p50_s']:.3f}",
                      f"{r['n_ok']:,}/{r['requests']:,}")
    console.print(table)
    if "one_hour_of_trace_on_64_workers_wall_s" in results:
        for backend, wall in results["one_hour_of_trace_on_64_workers_wall_s"].items():
            console.print(f"one hour of the trace on 64 workers ({backend}): {wall:.1f} s wall")
    if "floor_64_workers" in results:
        floor = results["floor_64_workers"]
        console.print(f"prefix-cache floor on 64 workers ({floor['blocks']:,} blocks hashed, indexed, evicted; "
                      f"nothing else): {floor['wall_s']:.1f} s wall")


if __name__ == "__main__":
    main()
