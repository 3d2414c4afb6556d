"""Side by side: two runs of benchmarks/laps_eval.py timed by different perf backends.

Rows are matched by (model, deployment, workload, load): Poisson loads by their load factor
(the rates differ: each run's rates are factors of its own backend's raw prefill capacity),
closed loops by their concurrency. For each LAPS-vs-baseline pair: the relative change of TTFT
mean / p90 (and of the short and long classes' p90 where classified) and the SLO violation
rates, under each backend.

    .venv/bin/python benchmarks/laps_compare.py bench-results/laps_measured/sweep_auto \\
        bench-results/laps_measured/sweep_datasheet --factors 0.4,0.7,1.0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _load(path: Path) -> dict[str, Any]:
    return json.loads((path / "laps_eval.json").read_text() if path.is_dir() else path.read_text())


def keyed(rows: list[dict[str, Any]], factors: list[float]) -> dict[tuple, dict[str, Any]]:
    """(model, deployment, workload, load label, system) -> row; rates labelled by factor."""
    rates: dict[tuple, list[float]] = {}
    for r in rows:
        if r["load"] == "rate":
            rates.setdefault((r["model"], r["deployment"], r["workload"]), []).append(r["value"])
    out = {}
    for r in rows:
        if r["load"] == "rate":
            ordered = sorted(set(rates[(r["model"], r["deployment"], r["workload"])]))
            label = f"{factors[ordered.index(r['value'])]:g}x" if len(ordered) == len(factors) else f"rate {r['value']}"
        else:
            label = f"c={r['value']}"
        out[(r["model"], r["deployment"], r["workload"], label, r["system"])] = r
    return out


def _chg(base: dict, laps: dict, key: str) -> str:
    b, v = base.get(key), laps.get(key)
    return "–" if not b or v is None else f"{v / b - 1:+.0%}"


def _viol(base: dict, laps: dict) -> str:
    return f"{base['violation_rate']:.1%}→{laps['violation_rate']:.1%}"


def compare_table(runs: dict[str, dict[str, Any]], factors: list[float],
                  baselines: tuple[str, ...] = ("vanilla PD", "LB router", "vanilla PD (sessions)",
                                                "LB router (sessions)")) -> str:
    """Markdown: per cell and baseline, LAPS' changes under each backend (columns in `runs` order)."""
    tables = {name: keyed(run["rows"], factors) for name, run in runs.items()}
    names = list(runs)
    first = tables[names[0]]
    cells = sorted({k[:4] for k in first}, key=lambda k: (k[0], k[1], k[2], k[3].startswith("c="),
                                                         float(k[3].rstrip("x").split("=")[-1].split()[-1])))
    head = " | ".join(f"TTFT mean / p90 / short p90 / long p90, {n}" for n in names)
    viol = " | ".join(f"violations base→LAPS, {n}" for n in names)
    lines = [f"| model | deployment | workload | load | LAPS vs | {head} | {viol} |",
             "| --- | --- | --- | --- | --- |" + " --- |" * (2 * len(names))]
    for cell in cells:
        for baseline in baselines:
            got = []
            for n in names:
                t = tables[n]
                base, laps = t.get(cell + (baseline,)), t.get(cell + ("LAPS",))
                got.append((base, laps))
            if not all(b and lp for b, lp in got):
                continue
            changes = " | ".join(f"{_chg(b, lp, 'ttft_mean_ms')} / {_chg(b, lp, 'ttft_p90_ms')} / "
                                 f"{_chg(b, lp, 'short_ttft_p90_ms')} / {_chg(b, lp, 'long_ttft_p90_ms')}"
                                 for b, lp in got)
            viols = " | ".join(_viol(b, lp) for b, lp in got)
            lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {cell[3]} | {baseline} | {changes} | {viols} |")
    return "\n".join(lines) + "\n"


def absolute_table(runs: dict[str, dict[str, Any]], factors: list[float]) -> str:
    """Markdown: every system's TTFT mean / p90 and violations per cell, under each backend."""
    tables = {name: keyed(run["rows"], factors) for name, run in runs.items()}
    names = list(runs)
    keys = sorted(tables[names[0]], key=lambda k: (k[0], k[1], k[2], k[3].startswith("c="),
                                                   float(k[3].rstrip("x").split("=")[-1].split()[-1]), k[4]))
    lines = ["| model | deployment | workload | load | system | " + " | ".join(
        f"TTFT mean / p90 ms, short / long p90 ms, violations ({n})" for n in names) + " |",
        "| --- | --- | --- | --- | --- |" + " --- |" * len(names)]
    for k in keys:
        parts = []
        for n in names:
            r = tables[n].get(k)
            if r is None:
                parts.append("–")
                continue
            sp, lp = r.get("short_ttft_p90_ms"), r.get("long_ttft_p90_ms")
            parts.append(f"{r['ttft_mean_ms']:.0f} / {r['ttft_p90_ms']:.0f}, "
                         f"{'–' if sp is None else f'{sp:.0f}'} / {'–' if lp is None else f'{lp:.0f}'}, "
                         f"{r['violation_rate']:.1%}")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="laps_eval output dirs (or laps_eval.json files)")
    parser.add_argument("--factors", default="0.4,0.7,1.0", help="The runs' Poisson load factors, ascending.")
    parser.add_argument("--absolute", action="store_true", help="Also every system's absolute figures.")
    args = parser.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    runs = {}
    for path in args.runs:
        data = _load(path)
        backend = data.get("perf_backend", "?")
        runs[backend if backend not in runs else f"{backend} ({path.name})"] = data
    for name, data in runs.items():
        for model, note in (data.get("step_times") or {}).items():
            print(f"{name}: {model}: {note}")
    print()
    print(compare_table(runs, factors))
    if args.absolute:
        print(absolute_table(runs, factors))


if __name__ == "__main__":
    main()
