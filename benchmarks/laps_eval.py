"""LAPS' evaluation (arXiv 2601.11589 §4) in the simulator: prefill latency and SLO violations.

Deployments (the roofline presets of `splitserve/perf_presets.py`, H200):

* **temporal**: 1 prefill instance and 2 decode instances behind it (PD);
* **spatial**: 8 prefill instances and 4 decode instances behind them.

Systems, side by side on the same requests and arrivals:

* **vanilla PD**: `pd_disaggregated`, prefills dispatched round robin over the prefill
  instances (SGLang's data-parallel default), fcfs chunked prefill (2,048-token steps);
* **LB router**: `pd_disaggregated` with least-loaded prefill routing (SGLang-router-like);
* **LAPS**: `laps` placement (short/long pools by L_m, the pressure controller, long
  overflow) + the `laps` local batch policy (short/long apart in time, AWD batching to
  captured shapes, C_l chunks);
* ablations: **pools only** (`laps` placement, fcfs locally) and **batching only**
  (least-loaded PD routing, `laps` locally).

In temporal mode (one prefill instance) the pools do not exist: LAPS is the local policy.

Workloads: the Mooncake conversation trace (its `hash_ids`: prompts sharing a prefix hit the
prefix cache, the re-prefill history) and the Azure 2023 conversation trace, request
lengths in trace order, closed-loop clients (concurrency 16 and 64), and Poisson arrivals
at load factors 0.4, 0.7 and 1.0 of the prefill instances' raw capacity (instances / the
mean prompt's prefill time by the preset, prefix-cache hits ignored). The physical floor
is reported beside: the share of requests whose prefill alone, on an idle instance without
a prefix-cache hit, already exceeds the TTFT SLO (Mooncake's prompts average 13.7 k tokens). TTFT SLO 0.4 s. Reported: TTFT mean / p90 / p99, SLO violations
(TTFT > 0.4 s or failed), request throughput; the pool controller's moves over time (plot).

Capture effects are not in the simulated times (a padded captured shape costs what the
model says for its real tokens): the simulator shows the scheduling, not CUDA graphs.

Capacity (`--parts capacity`): per model and workload in spatial mode, the highest Poisson
rate at which a system keeps SLO attainment at 90% of what is attainable (1 − the floor),
by `loadgen.metrics.find_capacity` over whole simulations, for vanilla PD, the LB router
and LAPS (the paper's "+35% request throughput" is throughput at an SLO).

    nice -n 5 .venv/bin/python -u benchmarks/laps_eval.py --out-dir bench-results/laps_eval
    nice -n 5 .venv/bin/python -u benchmarks/laps_eval.py --parts capacity --out-dir bench-results/laps_eval
    .venv/bin/python benchmarks/laps_eval.py --quick --out-dir bench-results/laps_eval_quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen import arrivals  # noqa: E402
from loadgen.traces import read_trace  # noqa: E402
from services.planner.sim_workload import SimRequestSpec, requests_from_trace  # noqa: E402
from services.planner.simulator import Simulator, pd_roles  # noqa: E402
from splitserve.perf_model import PerfModel  # noqa: E402

SLO_S = 0.4
TRACES = {"mooncake-conv": "mooncake_conversation_trace.jsonl", "azure-conv": "AzureLLMInferenceTrace_conv.csv"}
DEPLOYMENTS = {"temporal": (1, 2), "spatial": (8, 4)}  # (prefill instances, decode instances)
SYSTEMS: dict[str, dict[str, Any]] = {
    "vanilla PD": dict(placement_policy="pd_disaggregated", policy_params={"prefill_routing": "round_robin"}),
    "LB router": dict(placement_policy="pd_disaggregated"),
    "LAPS": dict(placement_policy="laps", batch_policy="laps"),
    "pools only": dict(placement_policy="laps"),
    "batching only": dict(placement_policy="pd_disaggregated", batch_policy="laps"),
}
TEMPORAL_SYSTEMS = ("vanilla PD", "LAPS")  # one prefill instance: routing and pools do not apply


@dataclass
class Workload:
    name: str
    specs: list[SimRequestSpec]

    def prefill_s(self, model: PerfModel) -> np.ndarray:
        return np.array([model.prefill_time(0, s.prompt_len) for s in self.specs])


def load_workloads(trace_dir: Path, n: int, log) -> list[Workload]:
    out = []
    for name, file in TRACES.items():
        path = trace_dir / file
        if not path.exists():
            log(f"skipping {name}: {path} not found (pass --trace-dir)")
            continue
        rows = read_trace(path)[:n]
        out.append(Workload(name, requests_from_trace(rows, name)))
    return out


def summarise(results) -> dict[str, Any]:
    ttft = np.array([r.ttft_s for r in results if r.ok and r.ttft_s is not None])
    violations = sum(1 for r in results if not r.ok or r.ttft_s is None or r.ttft_s > SLO_S)
    done = [r for r in results if r.ok]
    span = max((r.end_s for r in done), default=0.0) - min((r.arrival_s for r in results), default=0.0)
    pct = (lambda q: float(np.percentile(ttft, q) * 1000)) if len(ttft) else (lambda q: float("nan"))
    return {"requests": len(results), "ok": len(done), "ttft_mean_ms": float(ttft.mean() * 1000) if len(ttft) else None,
            "ttft_p50_ms": pct(50), "ttft_p90_ms": pct(90), "ttft_p99_ms": pct(99),
            "violations": violations, "violation_rate": violations / max(1, len(results)),
            "throughput_rps": len(done) / span if span > 0 else 0.0}


def run_one(gpu: str, model: str, deployment: str, system: str, workload: Workload, load: tuple[str, float],
            seed: int) -> dict[str, Any]:
    n_prefill, n_decode = DEPLOYMENTS[deployment]
    options = SYSTEMS[system]
    sim = Simulator.from_preset(n_prefill + n_decode, gpu, model, roles=pd_roles(n_prefill + n_decode, n_prefill),
                                placement_policy=options["placement_policy"],
                                policy_params=dict(options.get("policy_params", {})),
                                batch_policy=options.get("batch_policy", "fcfs"), slo_ttft_ms=round(SLO_S * 1000),
                                max_num_batched_tokens=2048)
    kind, value = load
    started = time.perf_counter()
    if kind == "rate":
        outcome = sim.run(workload.specs, arrivals.poisson(value), seed=seed)
    else:
        outcome = sim.run(workload.specs, None, concurrency=int(value), seed=seed)
    row = summarise(outcome.results)
    row.update(model=model, deployment=deployment, system=system, workload=workload.name, load=kind, value=value,
               wall_s=time.perf_counter() - started, pool_moves=outcome.stats.pool_moves)
    if outcome.stats.pool_timeline:
        row["pool_timeline"] = outcome.stats.pool_timeline
    return row


def plan(quick: bool) -> tuple[list[str], list[float], list[int]]:
    models = ["Qwen2.5-14B"] if quick else ["Qwen2.5-14B", "Qwen2.5-32B"]
    factors = [0.7] if quick else [0.4, 0.7, 1.0]
    concurrency = [64] if quick else [16, 64]
    return models, factors, concurrency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results/laps_eval"))
    parser.add_argument("--trace-dir", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--requests", type=int, default=1000, help="Requests per run (the traces' first N).")
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="One model, one load factor, one concurrency.")
    parser.add_argument("--parts", default="sweep", help="Comma list: sweep (the load sweep) | capacity.")
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"sweep", "capacity"}:
        raise SystemExit(f"--parts: sweep and/or capacity, got {args.parts!r}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    workloads = load_workloads(args.trace_dir, 600 if args.quick else args.requests, log)
    if not workloads:
        raise SystemExit("no trace found: pass --trace-dir (the Mooncake and Azure conversation traces)")
    models, factors, concurrency = plan(args.quick)
    if "capacity" in parts:
        capacity_part(args, models, workloads, log)
    if "sweep" not in parts:
        return
    rows = []
    floors = {}
    for model in models:
        preset = Simulator.from_preset(1, args.gpu, model).config.perf_model
        for deployment, (n_prefill, _) in DEPLOYMENTS.items():
            systems = TEMPORAL_SYSTEMS if deployment == "temporal" else tuple(SYSTEMS)
            for workload in workloads:
                prefill_s = workload.prefill_s(preset)
                floors[f"{model} {workload.name}"] = float((prefill_s > SLO_S).mean())
                capacity = n_prefill / float(prefill_s.mean())  # raw prefill capacity, req/s
                loads = [("rate", round(f * capacity, 3)) for f in factors] + [("concurrency", c) for c in concurrency]
                for load in loads:
                    for system in systems:
                        row = run_one(args.gpu, model, deployment, system, workload, load, args.seed)
                        row["floor_violation_rate"] = floors[f"{model} {workload.name}"]
                        rows.append(row)
                        log(f"{model:12s} {deployment:8s} {workload.name:13s} {load[0]}={load[1]:<8} {system:14s} "
                            f"TTFT mean {row['ttft_mean_ms']:8.1f} p90 {row['ttft_p90_ms']:8.1f} "
                            f"p99 {row['ttft_p99_ms']:8.1f} ms  viol {row['violation_rate']:6.1%}  "
                            f"{row['throughput_rps']:6.2f} req/s  moves {row['pool_moves']}  ({row['wall_s']:.1f} s)")
    results = {"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "machine": {"platform": platform.platform(), "python": platform.python_version(),
                           "cpus": os.cpu_count()},
               "gpu": args.gpu, "slo_ttft_s": SLO_S, "requests": args.requests, "violation_floors": floors}
    (args.out_dir / "laps_eval.json").write_text(json.dumps(results, indent=1))
    comparisons = compare(rows)
    (args.out_dir / "laps_eval.md").write_text(markdown(rows, comparisons))
    print(markdown(rows, comparisons))
    for path in plots(rows, args.out_dir):
        log(f"wrote {path}")


CAPACITY_SYSTEMS = ("vanilla PD", "LB router", "LAPS")


def capacity_part(args: argparse.Namespace, models: Sequence[str], workloads: Sequence[Workload], log) -> None:
    """Spatial mode: each system's highest Poisson rate keeping attainment >= 90% of 1 − floor."""
    from loadgen.metrics import find_capacity

    rows = []
    n_prefill, _ = DEPLOYMENTS["spatial"]
    for model in models:
        preset = Simulator.from_preset(1, args.gpu, model).config.perf_model
        for workload in workloads:
            prefill_s = workload.prefill_s(preset)
            floor = float((prefill_s > SLO_S).mean())
            target = 0.9 * (1 - floor)
            raw = n_prefill / float(prefill_s.mean())
            for system in CAPACITY_SYSTEMS:
                def attainment(rate: float) -> float:
                    row = run_one(args.gpu, model, "spatial", system, workload, ("rate", rate), args.seed)
                    return 1 - row["violation_rate"]

                found = find_capacity(attainment, target, lo=0.25 * raw, hi=raw, tol=0.02 * raw, max_iters=12)
                rows.append(dict(model=model, workload=workload.name, system=system, target=target, floor=floor,
                                 capacity_rps=found.rate, probes=[(p.rate, p.attainment) for p in found.probes]))
                log(f"capacity {model:12s} {workload.name:13s} {system:12s} {found.rate:8.2f} req/s "
                    f"(attainment >= {target:.1%}, {len(found.probes)} probes)")
    lines = ["| model | workload | attainment target | vanilla PD | LB router | LAPS | LAPS vs PD / router |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model in models:
        for workload in workloads:
            got = {r["system"]: r for r in rows if (r["model"], r["workload"]) == (model, workload.name)}
            pd, lb, laps = (got[s]["capacity_rps"] for s in CAPACITY_SYSTEMS)
            lines.append(f"| {model} | {workload.name} | {got['LAPS']['target']:.1%} | {pd:.2f} | {lb:.2f} | "
                         f"{laps:.2f} | {_pct(laps / pd - 1 if pd else None)} / {_pct(laps / lb - 1 if lb else None)} |")
    table = "\n".join(lines) + "\n"
    (args.out_dir / "laps_eval_capacity.json").write_text(json.dumps(
        {"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}, indent=1))
    (args.out_dir / "laps_eval_capacity.md").write_text(table)
    print(table)


def compare(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """LAPS against each baseline per (model, deployment, workload, load): relative changes."""
    keyed = {(r["model"], r["deployment"], r["workload"], r["load"], r["value"], r["system"]): r for r in rows}
    out = []
    for (model, deployment, workload, load, value, system), laps in keyed.items():
        if system != "LAPS":
            continue
        for baseline in ("vanilla PD", "LB router"):
            base = keyed.get((model, deployment, workload, load, value, baseline))
            if base is None:
                continue

            def change(key: str) -> float | None:
                b, v = base.get(key), laps.get(key)
                return None if not b or v is None else v / b - 1

            out.append(dict(model=model, deployment=deployment, workload=workload, load=load, value=value,
                            baseline=baseline, ttft_mean=change("ttft_mean_ms"), ttft_p90=change("ttft_p90_ms"),
                            violations=(laps["violations"] - base["violations"]) / base["violations"]
                            if base["violations"] else None,
                            throughput=change("throughput_rps")))
    return out


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.0%}"


def markdown(rows: Sequence[dict[str, Any]], comparisons: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | deployment | workload | load | system | TTFT mean / p90 / p99 ms | SLO violations (floor) | "
             "req/s | pool moves |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['deployment']} | {r['workload']} | {r['load']} {r['value']} | "
                     f"{r['system']} | {r['ttft_mean_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['violation_rate']:.1%} ({r.get('floor_violation_rate', 0):.0%}) | {r['throughput_rps']:.2f} | "
                     f"{r['pool_moves']} |")
    lines += ["", "| model | deployment | workload | load | LAPS vs | TTFT mean | TTFT p90 | SLO violations | req/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in comparisons:
        lines.append(f"| {c['model']} | {c['deployment']} | {c['workload']} | {c['load']} {c['value']} | "
                     f"{c['baseline']} | {_pct(c['ttft_mean'])} | {_pct(c['ttft_p90'])} | {_pct(c['violations'])} | "
                     f"{_pct(c['throughput'])} |")
    return "\n".join(lines) + "\n"


def plots(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rate_rows = [r for r in rows if r["load"] == "rate"]
    groups = sorted({(r["model"], r["deployment"], r["workload"]) for r in rate_rows})
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
        for ax, (model, deployment, workload) in zip(axes[0], groups):
            for system in SYSTEMS:
                points = sorted((r["value"], r["ttft_p90_ms"]) for r in rate_rows if (r["model"], r["deployment"],
                                r["workload"], r["system"]) == (model, deployment, workload, system))
                if points:
                    ax.plot(*zip(*points), marker="o", label=system)
            ax.set_title(f"{model}\n{deployment}, {workload}", fontsize=8)
            ax.set_xlabel("Poisson rate (req/s)")
            ax.set_ylabel("TTFT p90 (ms)")
            ax.set_yscale("log")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "laps_eval_ttft_p90.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    timed = [r for r in rows if r.get("pool_timeline") and r["system"] == "LAPS" and r["deployment"] == "spatial"]
    if timed:
        busiest = max(timed, key=lambda r: (r["pool_moves"], r["value"] if r["load"] == "rate" else 0))
        t, p_s, p_l, n_s, n_l = np.array(busiest["pool_timeline"]).T
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 4.5), sharex=True)
        top.step(t, n_s, where="post", label="short pool")
        top.step(t, n_l, where="post", label="long pool")
        top.set_ylabel("instances")
        top.legend(fontsize=7)
        top.set_title(f"pool controller: {busiest['model']}, {busiest['workload']}, {busiest['load']} "
                      f"{busiest['value']} ({busiest['pool_moves']} moves)", fontsize=9)
        bottom.plot(t, p_s, label="P_s (P90 of ψ)")
        bottom.plot(t, p_l, label="P_l")
        bottom.set_xlabel("virtual time (s)")
        bottom.set_ylabel("pool pressure")
        bottom.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "laps_eval_controller.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    main()
