"""The serving framework's per-step cost, fitted to end-to-end GPU measurements (issue 34).

aiconfigurator ships, beside its per-kernel database, end-to-end measurements of real serving
runs (`aiconfigurator_core/systems/silicon_sample.csv`: mean TTFT and TPOT of closed-loop runs
of c concurrent requests of isl prompt and osl output tokens, per framework, GPU, model, TP).
This benchmark takes every vLLM aggregated (colocated) bf16 run of a model and GPU the measured
tables cover, simulates the same run in virtual time on the kernel tables alone
(`--perf-backend aiconfigurator-kernels`: one worker, chunked prefill of 8,192 tokens, vLLM's
default on an H100; the c clients closed-loop), and fits the TPOT the kernels miss as

    TPOT_measured - TPOT_kernels = overhead + per_seq * c + (kernel_scale - 1) * TPOT_kernels

by non-negative least squares over the runs the simulator does not push into KV preemption.
Then it simulates every run again with the fitted constants (`splitserve.perf.framework`) and
reports how far each lands; two hold-out checks refit without a slice (prompts of 4,096 tokens;
TP 8) and predict it. Runs where the simulator preempts (the KV cache full) are reported apart:
their TPOT depends on how each engine preempts, not on the per-step cost.

    .venv/bin/python benchmarks/framework_overhead.py --out-dir bench-results/framework_overhead

Everything simulated is virtual time on measured GPU data; the reference is aiconfigurator's
end-to-end measurements of vLLM on real GPUs. Nothing here runs on a GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from common import REPO

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from services.planner.sim_workload import SimRequestSpec  # noqa: E402
from services.planner.simulator import Simulator, preset_kv_blocks  # noqa: E402
from splitserve.perf.aiconfigurator import SYSTEMS  # noqa: E402
from splitserve.perf.backends import perf_model_for  # noqa: E402
from splitserve.perf.framework import FRAMEWORK_OVERHEADS, FrameworkOverhead, with_framework_overhead  # noqa: E402
from splitserve.perf.presets import MODEL_SPECS  # noqa: E402

console = Console(width=160)
CHUNK_TOKENS = 8192  # vLLM's max_num_batched_tokens for its API server on >= 70 GiB GPUs other than the A100


def silicon_path() -> Path:
    import aiconfigurator_core

    return Path(aiconfigurator_core.__file__).parent / "systems" / "silicon_sample.csv"


def silicon_runs(framework: str = "vllm") -> list[dict[str, Any]]:
    """The end-to-end runs the measured tables can replay: `framework`, aggregated, bf16 (no
    quantisation named), a model preset of this project (by its Hugging Face id) on a GPU it tabulates."""
    gpus = {system: name for name, system in SYSTEMS.items()}
    models = {m.hf_id: name for name, m in MODEL_SPECS.items()}
    runs = []
    with silicon_path().open() as f:
        for row in csv.DictReader(f):
            if (row["backend"] != framework or row["mode"] != "agg" or row["precision"] or row["gemm_quant_mode"]
                    or row["system"] not in gpus or row["model_path"] not in models):
                continue
            runs.append({"id": row["id"], "gpu": gpus[row["system"]], "model": models[row["model_path"]],
                         "version": row["backend_version"], "tp": int(float(row["tp_size"])),
                         "concurrency": int(float(row["batch_size"])), "isl": int(row["isl"]), "osl": int(row["osl"]),
                         "tpot_ms": float(row["silicon_tpot_ms"]), "ttft_ms": float(row["silicon_ttft_ms"])})
    return sorted(runs, key=lambda r: (r["model"], r["gpu"], r["tp"], r["isl"], r["osl"], r["concurrency"]))


def simulate(run: dict[str, Any], overhead: FrameworkOverhead | None, framework: str = "vllm") -> dict[str, float]:
    """The run in virtual time: mean TPOT and TTFT (ms) and KV preemptions."""
    kernels = perf_model_for(run["gpu"], run["model"], run["tp"], backend="aiconfigurator-kernels", framework=framework)
    model = with_framework_overhead(kernels, framework, overhead) if overhead else kernels
    sim = Simulator(1, model, num_kv_blocks=preset_kv_blocks(run["gpu"], run["model"], run["tp"], 16),
                    max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=1024)
    c = run["concurrency"]
    items = [SimRequestSpec(f"r{i}", run["isl"], run["osl"]) for i in range(max(4 * c, 64))]
    outcome = sim.run(items, None, concurrency=c)
    done = [r for r in outcome.results if r.ok and r.first_token_s is not None and r.output_len > 1]
    return {"tpot_ms": statistics.fmean((r.end_s - r.first_token_s) / (r.output_len - 1) for r in done) * 1e3,
            "ttft_ms": statistics.fmean(r.ttft_s for r in done) * 1e3,
            "preemptions": int(outcome.stats.preemptions)}


def fit(rows: Sequence[dict[str, Any]], source: str) -> FrameworkOverhead:
    """Non-negative least squares of the TPOT residual on (1, c, kernel TPOT)."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.array([[1.0, r["concurrency"], r["kernels_tpot_ms"]] for r in rows])
    y = np.array([r["tpot_ms"] - r["kernels_tpot_ms"] for r in rows])
    coef, _ = nnls(a, y)
    return FrameworkOverhead(overhead_s=float(coef[0]) / 1e3, per_seq_s=float(coef[1]) / 1e3,
                             kernel_scale=1.0 + float(coef[2]), source=source)


def errors(rows: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    errs = [abs(r[key] / r["tpot_ms"] - 1) for r in rows]
    signed = [r[key] / r["tpot_ms"] - 1 for r in rows]
    return {"runs": len(rows), "median_abs": statistics.median(errs), "max_abs": max(errs),
            "median_signed": statistics.median(signed), "within_10pct": sum(e <= 0.10 for e in errs) / len(errs),
            "within_20pct": sum(e <= 0.20 for e in errs) / len(errs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path("bench-results/framework_overhead"))
    ap.add_argument("--framework", default="vllm")
    args = ap.parse_args()
    started = time.perf_counter()
    runs = silicon_runs(args.framework)
    if not runs:
        raise SystemExit(f"no bf16 aggregated {args.framework} run of a tabulated model in {silicon_path()}")
    for run in runs:
        sim = simulate(run, None, args.framework)
        run.update(kernels_tpot_ms=sim["tpot_ms"], kernels_ttft_ms=sim["ttft_ms"], preemptions=sim["preemptions"])
    clean = [r for r in runs if r["preemptions"] == 0]
    versions = sorted({r["version"] for r in runs})
    what = (f"aiconfigurator-core silicon_sample.csv: {args.framework} {', '.join(versions)} agg, "
            f"{', '.join(sorted({r['model'] for r in clean}))} bf16, "
            f"{', '.join(sorted({r['gpu'] for r in clean}))} TP{'/'.join(str(t) for t in sorted({r['tp'] for r in clean}))}")
    fitted = fit(clean, what)
    holdouts = {"isl 4096": lambda r: r["isl"] == 4096, "TP 8": lambda r: r["tp"] == 8}
    held: dict[str, Any] = {}
    for name, test in holdouts.items():
        train = [r for r in clean if not test(r)]
        if train and len(train) < len(clean):
            held[name] = {"fit": fit(train, f"all but {name}"), "rows": [r for r in clean if test(r)]}
    for run in runs:
        run["fitted_tpot_ms"] = simulate(run, fitted, args.framework)["tpot_ms"]
        for name, h in held.items():
            if run in h["rows"]:
                run[f"holdout_tpot_ms"] = simulate(run, h["fit"], args.framework)["tpot_ms"]
    summary = {"kernels only": errors(clean, "kernels_tpot_ms"), "fitted": errors(clean, "fitted_tpot_ms")}
    for name, h in held.items():
        summary[f"hold-out: {name}"] = errors(h["rows"], "holdout_tpot_ms")
        summary[f"hold-out: {name} (kernels only)"] = errors(h["rows"], "kernels_tpot_ms")
    preempted = [r for r in runs if r["preemptions"] > 0]
    if preempted:
        summary["preempting runs, fitted"] = errors(preempted, "fitted_tpot_ms")

    table = Table(title=f"{args.framework} TPOT: measured end to end vs simulated (virtual time, measured kernels)")
    for col in ("model / GPU / TP", "isl / osl", "c", "measured ms", "kernels ms", "fitted ms", "err", "preempt"):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(f"{r['model']} / {r['gpu'].split('-')[0]} / {r['tp']}", f"{r['isl']} / {r['osl']}",
                      str(r["concurrency"]), f"{r['tpot_ms']:.2f}", f"{r['kernels_tpot_ms']:.2f}",
                      f"{r['fitted_tpot_ms']:.2f}", f"{r['fitted_tpot_ms'] / r['tpot_ms'] - 1:+.1%}",
                      str(r["preemptions"]))
    console.print(table)
    s = Table(title="TPOT error against the end-to-end measurements")
    for col in ("model", "runs", "median |err|", "max |err|", "median signed", "within 10%", "within 20%"):
        s.add_column(col, justify="right")
    for name, e in summary.items():
        s.add_row(name, str(e["runs"]), f"{e['median_abs']:.1%}", f"{e['max_abs']:.1%}", f"{e['median_signed']:+.1%}",
                  f"{e['within_10pct']:.0%}", f"{e['within_20pct']:.0%}")
    console.print(s)
    console.print(f"fitted: {fitted.describe()}")
    for name, h in held.items():
        console.print(f"hold-out {name}: {h['fit'].describe()}")
    shipped = FRAMEWORK_OVERHEADS.get(args.framework)
    console.print(f"shipped in splitserve.perf.framework: {shipped.describe() if shipped else None}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "framework": args.framework,
              "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
              "chunk_tokens": CHUNK_TOKENS, "fitted": fitted.describe(),
              "holdout_fits": {n: h["fit"].describe() for n, h in held.items()},
              "summary": summary, "runs": runs, "wall_s": time.perf_counter() - started}
    (args.out_dir / "framework_overhead.json").write_text(json.dumps(result, indent=1))
    plot(runs, args.out_dir / "framework_overhead.png")
    console.print(f"wrote {args.out_dir / 'framework_overhead.json'} ({result['wall_s']:.0f} s)")


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    measured = [r["tpot_ms"] for r in runs]
    ax.scatter(measured, [r["kernels_tpot_ms"] for r in runs], s=12, label="measured kernels alone")
    ax.scatter(measured, [r["fitted_tpot_ms"] for r in runs], s=12, label="kernels + fitted framework cost")
    top = max(measured) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set_xlabel("TPOT measured end to end (ms, vLLM on GPU)")
    ax.set_ylabel("TPOT simulated (ms, virtual time)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
