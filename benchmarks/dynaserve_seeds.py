"""DynaServe's capacity against its no-split ablations over several seeds (arrivals and samples).

One seed's capacity moves by up to 60% with the arrival sequence (100-request probes: the
steadiness test reads the realised queue), so a single run cannot tell a 10% gap from
noise; the systems share each seed's arrivals, so their ratios are paired. Prints each
capacity, the median per system and the median of the paired ratios to least-loaded
SLO-aware batching without a split; writes JSON.

    .venv/bin/python -u benchmarks/dynaserve_seeds.py --setup 14B --workloads "P8192/D32,Azure code" --seeds 5

`--slo-aware-option NAME=VALUE` (repeatable) sets an `slo_aware` option on every system that
batches with it, e.g. `kv_pressure_below=0.4` (the KV-pressure rule as it was on by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dynaserve_eval as de  # noqa: E402

SYSTEMS = ("DynaServe", "DynaServe+prompt_cuts", "least_loaded+slo_aware", "coloc+slo_aware", "coloc-256")
BASELINE = "least_loaded+slo_aware"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", default="14B", choices=sorted(de.SETUPS))
    ap.add_argument("--workloads", default="P8192/D32,Azure conversation,Azure code")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0,
                    help="seeds first-seed .. first-seed + seeds - 1 (to split a long run over processes)")
    ap.add_argument("--perf-backend", default="auto")
    ap.add_argument("--slo-aware-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an slo_aware batch-policy option for every system that uses it (repeatable)")
    ap.add_argument("--verify-multiple", type=float, default=3.0,
                    help="each capacity re-offered over this many windows, stepped down until it holds (0: off, "
                         "the search's figure as before 2026-11-30)")
    ap.add_argument("--verify-steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench-results/dynaserve_seeds.json"))
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    extra = dict(option.split("=", 1) for option in args.slo_aware_option)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    caps: dict[str, dict[str, list[float]]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run = argparse.Namespace(perf_backend=args.perf_backend, window_s=60.0, min_requests=100, seed=seed,
                                 ttft_growth_s=2.0, rate_tol=0.05, max_probes=7,
                                 verify_multiple=args.verify_multiple, verify_steps=args.verify_steps)
        bench = de.Bench(run, de.SETUPS[args.setup], slo_aware_options=extra)
        for workload in de.workloads(names, seed, lambda _: None):
            for system in systems:
                cap = bench.capacity(system, workload)["capacity_rps"]
                caps.setdefault(workload.name, {}).setdefault(system, []).append(cap)
                print(f"{args.setup} {workload.name} seed {seed} {system}: {cap:.3f} req/s", flush=True)
    print(f"\n| workload | system | median req/s | per seed | median ratio to {BASELINE} |\n| --- | --- | ---: | --- | ---: |")
    for name, rows in caps.items():
        base = rows.get(BASELINE)
        for system, values in rows.items():
            ratio = (f"{statistics.median(a / b for a, b in zip(values, base) if b > 0):.2f}x"
                     if base and any(b > 0 for b in base) else "-")
            print(f"| {name} | {system} | {statistics.median(values):.2f} | {' '.join(f'{v:.2f}' for v in values)} "
                  f"| {ratio} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "setup": args.setup, "perf_backend": args.perf_backend,
                                    "slo_aware_options": extra, "capacity_rps": caps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
