"""Do DynaServe cuts inside the prompt pay? Capacity with and without them, per timing backend.

DynaServe's search (services/global_scheduler/dynaserve.py) moves only from the prompt's end
on: a cut inside the prompt leaves the second worker waiting for the first's KV, so the
halves of a prompt run one after the other. That conclusion was drawn on the datasheet
roofline, where a step's cost does not depend on what shares it. Issue 34 asks to re-open it
on measured GPU timing (prefill and decode kernels add): `prompt_cuts=true` is the paper's
Alg. 1 search, the whole range [0, 1] balancing T1 = T2 without the wait (counted, the wait
makes a prompt cut never win the policy's own comparison, so only the simulator can say
whether such cuts pay). Same harness, SLO and capacity search as
benchmarks/dynaserve_eval.py (virtual time; A100 x Qwen2.5-14B, 2 workers).

    .venv/bin/python benchmarks/dynaserve_prompt_cuts.py --backends auto,datasheet \
        --out bench-results/dynaserve_prompt_cuts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import REPO

from dynaserve_eval import SETUPS, Bench, workloads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="auto", help="comma list of perf backends")
    ap.add_argument("--workloads", default="P8192/D32,P2048/D512,Azure code")
    ap.add_argument("--setup", default="14B")
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--min-requests", type=int, default=100)
    ap.add_argument("--max-probes", type=int, default=7)
    ap.add_argument("--rate-tol", type=float, default=0.05)
    ap.add_argument("--ttft-growth-s", type=float, default=2.0)
    ap.add_argument("--verify-multiple", type=float, default=3.0,
                    help="each capacity re-offered over this many windows, stepped down until it holds (0: off)")
    ap.add_argument("--verify-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "dynaserve_prompt_cuts.json")
    args = ap.parse_args()
    rows = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        args.perf_backend = backend
        bench = Bench(args, SETUPS[args.setup])
        for workload in workloads([w.strip() for w in args.workloads.split(",")], args.seed, print):
            row = {"backend": backend, "workload": workload.name,
                   "step_times": bench.sim("DynaServe").config.perf_model.timing_note}
            for system in ("DynaServe", "DynaServe+prompt_cuts"):
                started = time.perf_counter()
                cap = bench.capacity(system, workload)
                row[system] = cap["capacity_rps"]
                print(f"{backend} {workload.name} {system}: {cap['capacity_rps']:.3g} req/s "
                      f"({time.perf_counter() - started:.0f} s wall)", flush=True)
            row["ratio"] = row["DynaServe+prompt_cuts"] / row["DynaServe"] if row["DynaServe"] else None
            rows.append(row)
    print(f"{'backend':<10} {'workload':<12} {'from P-1 on':>12} {'prompt cuts':>12} {'ratio':>7}")
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        print(f"{r['backend']:<10} {r['workload']:<12} {r['DynaServe']:>12.3g} {r['DynaServe+prompt_cuts']:>12.3g} "
              f"{ratio:>7}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
