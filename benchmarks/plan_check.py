"""AMPD's planner (`splitserve plan`, §5) checked the way the paper's Table 2 is: its top
configurations against whole-cluster simulations of them, and its time at 256 GPUs.

For each workload of `ampd_eval` (Qwen3-32B on H20, the paper's SLOs and GPU budgets, the
session rate at half the budget's prefill capacity) the planner lists its top `--top`
configurations; each is then simulated as a whole cluster (the `ampd` policy, adaptive
routing) and the two rankings are compared: the simulation ranks by SLO attainment, a tie
in attainment going to the lower simulated Z (max of P95 TTFT and P95 ITL over their SLOs,
the planner's own objective). Each check sends about `--check-requests` session rounds
(sessions = that over the preset's mean rounds), so every check weighs about as many
requests: GAIA's sessions are 11 rounds of ~6k-token prompts, ToolBench's 4 of ~700. Then
`splitserve plan --gpus 256 --gpu H100 --model-preset llama-3.1-70b --sessions toolbench`
is timed `--repeats` times (median).

    flock /tmp/splitserve-bench.lock nice -n 10 .venv/bin/python -u benchmarks/plan_check.py \
        --out-dir /work/bench-results/plan_check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ampd_eval import WORKLOADS, prefill_capacity  # noqa: E402
from loadgen.sessions import PRESETS  # noqa: E402
from services.planner.deploy_plan import PlanInputs, check_plan, plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results/plan_check"))
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--check-requests", type=int, default=600,
                        help="session rounds per whole-cluster check (sessions = this / the preset's mean rounds)")
    parser.add_argument("--workloads", default=",".join(w.preset for w in WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for workload in WORKLOADS:
        if workload.preset not in args.workloads.split(","):
            continue
        rate = round(0.5 * prefill_capacity(workload), 3)
        inputs = PlanInputs(gpus=workload.gpus, gpu="H20", model="Qwen3-32B", sessions=workload.preset, rate=rate,
                            ttft_slo_ms=workload.ttft_ms, itl_slo_ms=workload.itl_ms, link="rdma-200g", top=args.top)
        started = time.perf_counter()
        result = plan(inputs)
        planned = time.perf_counter() - started
        sessions = math.ceil(args.check_requests / PRESETS[workload.preset].mean_rounds)
        started = time.perf_counter()
        checks = check_plan(result, result.candidates, sessions=sessions)
        checked = time.perf_counter() - started
        planner = [c.label for c in result.candidates]
        simulated = [row["label"] for row in checks]
        by_z = [row["label"] for row in sorted(checks, key=lambda row: (row["z"], row["planner_rank"]))]
        rows.append({"workload": workload.preset, "gpus": workload.gpus, "rate": rate, "plan_s": planned,
                     "simulations": result.simulations, "refined": result.refined,
                     "check_sessions": sessions, "check_s": checked,
                     "planner": [{"label": c.label, "z": c.z, "local_share": c.local_share,
                                  "ttft_p95_ms": c.ttft_p95_ms, "itl_p95_ms": c.itl_p95_ms}
                                 for c in result.candidates],
                     "simulated": checks, "top1_agrees": planner[:1] == simulated[:1],
                     "top3_agrees": planner[:3] == simulated[:3],
                     "top3_same_set": set(planner[:3]) == set(simulated[:3]),
                     # The same runs ranked by simulated Z alone (the planner's objective, no attainment).
                     "top1_agrees_by_z": planner[:1] == by_z[:1], "top3_agrees_by_z": planner[:3] == by_z[:3]})
        print(f"{workload.preset}: planned in {planned:.1f} s, checked in {checked:.1f} s ({sessions} sessions); "
              f"planner {planner[:3]}; simulated {simulated[:3]}", flush=True)
    command = [sys.executable, "-m", "splitserve.cli", "plan", "--gpus", "256", "--gpu", "H100", "--model-preset",
               "llama-3.1-70b", "--sessions", "toolbench"]
    walls = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        walls.append(time.perf_counter() - started)
    results = {"machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.python_version()}",
               "command": " ".join(["python", *sys.argv]), "rows": rows,
               "plan_256_wall_s": walls, "plan_256_median_s": statistics.median(walls)}
    (args.out_dir / "plan_check.json").write_text(json.dumps(results, indent=1))
    lines = ["| workload | GPUs | rate (sessions/s) | planner's top 3 (Z, local share) | whole-cluster simulation's "
             "top 3 (attainment, simulated Z; planner's rank) | top-1 / top-3 agree | by simulated Z: top-1 / top-3 |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        plan_text = "; ".join(f"{p['label']} ({p['z']:.2f}, {p['local_share']:g})" for p in row["planner"][:3])
        sim = "; ".join(f"{r['label']} ({r['attainment']:.1%}, {r['z']:.2f}; #{r['planner_rank']})"
                        for r in row["simulated"][:3])
        top3 = "yes" if row["top3_agrees"] else ("same set" if row["top3_same_set"] else "no")
        lines.append(f"| {row['workload']} | {row['gpus']} | {row['rate']} | {plan_text} | {sim} | "
                     f"{'yes' if row['top1_agrees'] else 'no'} / {top3} | "
                     f"{'yes' if row['top1_agrees_by_z'] else 'no'} / {'yes' if row['top3_agrees_by_z'] else 'no'} |")
    lines.append("\nAll five checked (planner's rank: simulated attainment, Z): " + " ".join(
        f"{row['workload']}: " + ", ".join(f"#{r['planner_rank']} {r['attainment']:.1%} {r['z']:.2f}"
                                           for r in sorted(row["simulated"], key=lambda r: r["planner_rank"])) + ";"
        for row in rows))
    lines.append(f"\n`splitserve plan --gpus 256 --gpu H100 --model-preset llama-3.1-70b --sessions toolbench`: "
                 f"median {statistics.median(walls):.2f} s wall over {len(walls)} runs "
                 f"({', '.join(f'{w:.2f}' for w in walls)}), process start included.")
    text = "\n".join(lines)
    (args.out_dir / "plan_check.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
