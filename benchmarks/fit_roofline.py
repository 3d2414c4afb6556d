"""Fit the kernel-class roofline's constants to NVIDIA aiconfigurator's measured database.

For every covered GPU (A100, H100, H200, L40S) and preset model (Llama-3-8B, Qwen2.5-14B,
Qwen2.5-32B, Qwen3-32B, Llama-3.1-70B at the smallest TP that fits with room for 16K KV
tokens; Llama-3-8B also at twice that TP, for the all-reduces), the measured backend
(`splitserve.perf.aiconfigurator.tabulate`, vllm, each GPU's current database) times a grid
of prefill steps (one chunk of L new tokens on H cached), decode steps (B sequences at mean
context C) and mixed steps (a chunk plus a decode batch), every shape within the model's
context length and the KV cache that fits beside the weights, and each kernel class on its
own grid (in whole steps the GEMMs' and the prefill attention's per-token costs always come
together; the classes tell them apart). `scipy.optimize.least_squares` then fits
`splitserve.perf.roofline.RooflineConstants` to those times in relative error, each (case,
step kind) and each (case, kernel class) weighted equally:

* one set per GPU generation (Ampere: A100; Hopper: H100, H200; Ada: L40S), and
* one set over all four GPUs (`all`),

and, to see how constants carry to a GPU the database lacks (the H20 rule), Hopper fitted on
H100 alone and scored on H200, and `all` fitted without L40S (without A100) and scored on it.
Scored but not fitted: attention times below the physical floor (the KV read at the full
datasheet bandwidth), and PCIe all-reduce beyond two GPUs (L40S x Llama-3.1-70B TP4). The table
gives, per GPU x model, the median and max relative error of prefill, decode and mixed steps
for the fitted roofline (through the same `PerfModel` code path, its analytic tables) and
for the old datasheet roofline beside it.

    .venv/bin/python benchmarks/fit_roofline.py --out bench-results/fit_roofline.json
    .venv/bin/python benchmarks/fit_roofline.py --write   # also rewrite FITTED in splitserve/perf/roofline.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import REPO

from scipy.optimize import least_squares  # noqa: E402

from splitserve.perf.aiconfigurator import tabulate  # noqa: E402
from splitserve.perf.presets import TP_DEGREES, gpu_spec, max_kv_tokens, model_spec, preset  # noqa: E402
from splitserve.perf.roofline import (GENERATION, RooflineConstants, RooflineKernels,  # noqa: E402
                                      roofline_model)

GPUS = ("A100", "H100", "H200", "L40S")
MODELS = ("Llama-3-8B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen3-32B", "Llama-3.1-70B")
MIN_KV_TOKENS = 16_384
KINDS = ("prefill", "decode", "mixed")
CLASS_WEIGHT = 1.0

PREFILL_L = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_H = (0, 512, 2048, 8192, 16384)
DECODE_B = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DECODE_C = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
MIXED_L = (64, 256, 512, 1024, 2048)
MIXED_H = (0, 4096)
MIXED_B = (4, 16, 64, 256)
MIXED_C = (512, 2048, 8192)

NAMES = [f.name for f in dataclasses.fields(RooflineConstants)]
START = RooflineConstants(gemm_eff=0.7, gemm_t_half=64.0, weight_bw=0.8, attn_eff=0.5, attn_k_half=256.0,
                          kv_bw=0.8, kernel_latency_s=3e-6, prefill_attn_latency_s=20e-6, decode_attn_latency_s=10e-6,
                          decode_seq_s=2e-8, allreduce_eff=0.5, allreduce_latency_s=5e-6, step_overhead_s=1e-5)
UPPER = {"gemm_eff": 1.0, "weight_bw": 1.0, "attn_eff": 1.0, "kv_bw": 1.0, "allreduce_eff": 1.0}


EXCLUDED_PCIE = ("PCIe all-reduce beyond two GPUs: aiconfigurator's L40S box all-reduces 1 GB at 19 GB/s bus bandwidth "
                 "over 2 GPUs but 3.7 GB/s over 4 and 2.0 GB/s over 8 (host-bridged PCIe), a topology no datasheet "
                 "states; scored, not fitted")


def combos() -> list[tuple[str, str, int]]:
    """(GPU, model, TP): the smallest TP with MIN_KV_TOKENS of KV beside the weights, and
    Llama-3-8B at twice it."""
    out = []
    for gpu in GPUS:
        for model in MODELS:
            tp = next(t for t in TP_DEGREES if max_kv_tokens(gpu, model, t) >= MIN_KV_TOKENS)
            out.append((gpu, model, tp))
            if model == "Llama-3-8B":
                out.append((gpu, model, 2 * tp))
    return out


def shapes(model: str, kv_cap: int) -> dict[str, np.ndarray]:
    """Per kind an array of (chunk L, history H, decode B, context C) rows within the model's
    context and the KV cache."""
    ctx = model_spec(model).context_len
    rows: dict[str, list] = {k: [] for k in KINDS}
    for n in PREFILL_L:
        for h in PREFILL_H:
            if n + h <= min(ctx, kv_cap):
                rows["prefill"].append((n, h, 0, 0))
    for b in DECODE_B:
        for c in DECODE_C:
            if c <= ctx and b * c <= kv_cap:
                rows["decode"].append((0, 0, b, c))
    for n in MIXED_L:
        for h in MIXED_H:
            for b in MIXED_B:
                for c in MIXED_C:
                    if n + h <= ctx and c <= ctx and n + h + b * c <= kv_cap:
                        rows["mixed"].append((n, h, b, c))
    return {k: np.array(v, dtype=np.float64) for k, v in rows.items()}


CLASS_T = (1, 4, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192, 16384)
CLASS_ROWS = (1, 16, 64, 256, 1024)
CLASS_L = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CLASS_H = (0, 512, 2048, 8192, 16384)
CLASS_B = (1, 4, 16, 64, 256, 1024)
CLASS_C = (16, 128, 512, 2048, 8192, 32768)
CLASSES = ("linear", "logits", "prefill_attention", "decode_attention")


def measure(gpu: str, model: str, tp: int) -> dict[str, Any]:
    measured = tabulate(gpu, model, tp)
    t = measured.tables
    cap = max_kv_tokens(gpu, model, tp)
    ctx = model_spec(model).context_len
    grid = shapes(model, cap)
    times = {k: np.array([measured.mixed_step_time(int(n), int(h), int(b), float(c)) for n, h, b, c in rows])
             for k, rows in grid.items()}
    # The kernel classes on their own (the tables' columns), so that each constant is the class's
    # and not another class's stand-in: in whole steps the GEMMs' and the prefill attention's
    # per-token costs always come together.
    pa = np.array([(n, h) for n in CLASS_L for h in CLASS_H if n + h <= ctx], dtype=np.float64)
    da = np.array([(b, c) for b in CLASS_B for c in CLASS_C if c <= ctx], dtype=np.float64)
    pa_y = np.array([t.prefill_attention_s(n, h) for n, h in pa])
    da_y = np.array([t.decode_attention_s(b, c) for b, c in da])
    # Attention times below the physical floor (the KV read at the datasheet's full HBM bandwidth)
    # are not measurements of that shape: the database's context attention of a few tokens on a
    # long history does not read the history (e.g. L40S x Qwen2.5-14B, 1 token on 16K cached:
    # 1.05 ms for a 3.2 GB read, 3.7 ms at 864 GB/s). They are scored, not fitted.
    k = RooflineKernels(gpu, model, tp)
    pa_ok = pa_y >= k.kv * (pa[:, 0] + pa[:, 1]) / k.hbm
    da_ok = da_y >= k.kv * da[:, 0] * da[:, 1] / k.hbm
    classes = {
        "linear": (np.array(CLASS_T, dtype=np.float64), np.array([t.linear_s(x, True) for x in CLASS_T])),
        "logits": (np.array(CLASS_ROWS, dtype=np.float64), np.array([t.logits_s(x) for x in CLASS_ROWS])),
        "prefill_attention": (pa[pa_ok], pa_y[pa_ok]),
        "decode_attention": (da[da_ok], da_y[da_ok]),
    }
    below_floor = {"prefill_attention": [[float(a), float(b)] for a, b in pa[~pa_ok]],
                   "decode_attention": [[float(a), float(b)] for a, b in da[~da_ok]]}
    return {"gpu": gpu, "model": model, "tp": tp, "kv_cap": cap, "shapes": grid, "measured": times,
            "classes": classes, "below_floor": below_floor, "label": measured.label,
            "database_version": measured.tables.source["database_version"]}


def class_times(case: dict[str, Any], constants: RooflineConstants) -> dict[str, np.ndarray]:
    k = RooflineKernels(case["gpu"], case["model"], case["tp"], constants=constants)
    cl = case["classes"]
    return {"linear": k.linear_s(cl["linear"][0]), "logits": k.logits_s(cl["logits"][0]),
            "prefill_attention": k.prefill_attention_s(cl["prefill_attention"][0][:, 0],
                                                       cl["prefill_attention"][0][:, 1]),
            "decode_attention": k.decode_attention_s(cl["decode_attention"][0][:, 0],
                                                     cl["decode_attention"][0][:, 1])}


def closed_form(case: dict[str, Any], constants: RooflineConstants) -> dict[str, np.ndarray]:
    k = RooflineKernels(case["gpu"], case["model"], case["tp"], constants=constants)
    return {kind: k.step_s(*rows.T) for kind, rows in case["shapes"].items()}


def through_model(case: dict[str, Any], model) -> dict[str, np.ndarray]:
    """Step times through a PerfModel (the path the simulator and workers use)."""
    return {kind: np.array([model.mixed_step_time(int(n), int(h), int(b), float(c)) for n, h, b, c in rows])
            for kind, rows in case["shapes"].items()}


def residuals(vector: np.ndarray, cases: list[dict[str, Any]]) -> np.ndarray:
    """Relative errors, each (case, step kind) and each (case, kernel class) weighted as one."""
    constants = RooflineConstants.from_vector(vector)
    out = []
    for case in cases:
        if case.get("excluded"):
            continue
        pred = closed_form(case, constants)
        for kind in KINDS:
            y = case["measured"][kind]
            if len(y):
                out.append((pred[kind] - y) / y / np.sqrt(len(y)))
        cls = class_times(case, constants)
        for name in CLASSES:
            y = case["classes"][name][1]
            out.append(CLASS_WEIGHT * (cls[name] - y) / y / np.sqrt(len(y)))
    return np.concatenate(out)


def fit(cases: list[dict[str, Any]], start: RooflineConstants = START) -> tuple[RooflineConstants, float]:
    lower = np.zeros(len(NAMES))
    upper = np.array([UPPER.get(n, np.inf) for n in NAMES])
    lower[[NAMES.index(n) for n in UPPER]] = 1e-3
    best = None
    x0s = [np.array(dataclasses.astuple(start))]
    x0s.append(x0s[0] * np.where([n in UPPER for n in NAMES], 1.0, 2.0))  # a second start: larger floors
    for x0 in x0s:
        x0 = np.clip(x0, lower + 1e-12, upper)
        scale = np.where(x0 > 0, x0, 1e-6)
        sol = least_squares(residuals, x0, args=(cases,), bounds=(lower, upper), x_scale=scale, method="trf",
                            diff_step=1e-4, max_nfev=3000, xtol=1e-10, ftol=1e-10)
        if best is None or sol.cost < best.cost:
            best = sol
    # Rounded as checked in (four significant digits, sub-nanosecond costs 0): every error below
    # is of the constants splitserve/perf/roofline.py holds.
    return RooflineConstants.from_vector([float(_fmt(v)) for v in best.x]), float(best.cost)


def errors(pred: dict[str, np.ndarray], case: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        y = case["measured"][kind]
        if len(y):
            rel = np.abs(pred[kind] - y) / y
            out[kind] = {"n": int(len(y)), "median": float(np.median(rel)), "max": float(np.max(rel)),
                         "signed_median": float(np.median((pred[kind] - y) / y))}
    return out


def class_errors(case: dict[str, Any], constants: RooflineConstants) -> dict[str, dict[str, float]]:
    pred = class_times(case, constants)
    out = {}
    for name in CLASSES:
        y = case["classes"][name][1]
        rel = np.abs(pred[name] - y) / y
        out[name] = {"n": int(len(y)), "median": float(np.median(rel)), "max": float(np.max(rel))}
    return out


def gen_of(gpu: str) -> str:
    return GENERATION[gpu_spec(gpu).name]


def format_constants(fitted: dict[str, RooflineConstants], source: dict[str, Any]) -> str:
    lines = ["FITTED: Mapping[str, RooflineConstants] = MappingProxyType({"]
    for name, c in fitted.items():
        args = ", ".join(f"{f}={_fmt(getattr(c, f))}" for f in NAMES)
        lines.append(f'    "{name}": RooflineConstants({args}),')
    lines.append("})")
    lines.append(f"FIT_SOURCE: Mapping[str, Any] = MappingProxyType({json.dumps(source, sort_keys=True)})")
    text = "\n".join(lines)
    # wrap long lines at the commas (the repository's 120-column style)
    wrapped = []
    for line in text.splitlines():
        while len(line) > 118:
            cut = line.rfind(", ", 0, 118)
            wrapped.append(line[:cut + 1])
            line = "        " + line[cut + 2:]
        wrapped.append(line)
    return "\n".join(wrapped)


def _fmt(v: float) -> str:
    """Four significant digits; a fixed cost below a nanosecond is 0 (the bound it ran into)."""
    return "0.0" if abs(v) < 1e-9 else repr(float(f"{v:.4g}"))


def write_constants(text: str) -> None:
    path = REPO / "splitserve" / "perf" / "roofline.py"
    src = path.read_text()
    new, n = re.subn(r"(# BEGIN FITTED\n).*?(\n# END FITTED)", lambda m: m.group(1) + text + m.group(2), src,
                     flags=re.S)
    if n != 1:
        raise SystemExit("could not find the FITTED markers in splitserve/perf/roofline.py")
    path.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench-results" / "fit_roofline.json"))
    ap.add_argument("--write", action="store_true", help="rewrite FITTED in splitserve/perf/roofline.py")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    t0 = time.perf_counter()
    cases = [measure(*c) for c in combos()]
    for case in cases:
        if not gpu_spec(case["gpu"]).nvlink_gbs and case["tp"] > 2:
            case["excluded"] = EXCLUDED_PCIE
    n_samples = sum(len(y) for c in cases for y in c["measured"].values())
    print(f"{len(cases)} GPU x model x TP cases, {n_samples} steps measured ({time.perf_counter() - t0:.1f} s)")

    fitted: dict[str, RooflineConstants] = {}
    costs: dict[str, float] = {}
    fitted["all"], costs["all"] = fit(cases)
    for gen in ("ampere", "hopper", "ada"):
        fitted[gen], costs[gen] = fit([c for c in cases if gen_of(c["gpu"]) == gen], fitted["all"])
    # Transfer checks: constants fitted without a GPU, scored on it.
    holdout = {
        "hopper fitted on H100 only, scored on H200":
            (fit([c for c in cases if c["gpu"] == "H100"], fitted["hopper"])[0], "H200"),
        "all fitted without L40S, scored on L40S":
            (fit([c for c in cases if c["gpu"] != "L40S"], fitted["all"])[0], "L40S"),
        "all fitted without A100, scored on A100":
            (fit([c for c in cases if c["gpu"] != "A100"], fitted["all"])[0], "A100"),
    }
    print(f"fits done ({time.perf_counter() - t0:.1f} s)")

    rows = []
    for case in cases:
        gen = gen_of(case["gpu"])
        per_gen = roofline_model(case["gpu"], case["model"], case["tp"], check_memory=False,
                                 constants=fitted[gen])
        row = {k: case[k] for k in ("gpu", "model", "tp", "kv_cap", "label", "database_version")}
        row["roofline"] = errors(through_model(case, per_gen), case)
        row["roofline_closed_form"] = errors(closed_form(case, fitted[gen]), case)
        row["roofline_all"] = errors(closed_form(case, fitted["all"]), case)
        row["classes"] = class_errors(case, fitted[gen])
        row["excluded"] = case.get("excluded", "")
        row["below_floor"] = case["below_floor"]
        row["datasheet"] = errors(through_model(case, preset(case["gpu"], case["model"], case["tp"],
                                                             check_memory=False)), case)
        for name, (consts, gpu) in holdout.items():
            if case["gpu"] == gpu:
                row["holdout"] = {"name": name, **errors(closed_form(case, consts), case)}
        rows.append(row)

    def cell(e: dict[str, dict[str, float]], kind: str) -> str:
        return f"{100 * e[kind]['median']:.0f} / {100 * e[kind]['max']:.0f}" if kind in e else "-"

    def summary(key: str, subset=None) -> dict[str, dict[str, float]]:
        out = {}
        for kind in KINDS:
            rels = []
            for case, row in zip(cases, rows):
                if (subset and not subset(case)) or case.get("excluded"):
                    continue
                if key == "holdout" and "holdout" not in row:
                    continue
                e = row[key]
                if kind in e:
                    rels.append(e[kind])
            out[kind] = {"median_of_medians": float(np.median([r["median"] for r in rels])),
                         "max": float(max(r["max"] for r in rels))}
        return out

    header = ("| GPU | model | TP | roofline prefill | roofline decode | roofline mixed | "
              "datasheet prefill | datasheet decode | datasheet mixed |")
    print()
    print("Relative error vs aiconfigurator (vllm), median / max %, per GPU x model:")
    print(header)
    print("|" + " --- |" * 9)
    for row in rows:
        print(f"| {row['gpu']} | {row['model']}{' (not fitted)' if row['excluded'] else ''} | {row['tp']} | "
              + " | ".join(cell(row["roofline"], k) for k in KINDS) + " | "
              + " | ".join(cell(row["datasheet"], k) for k in KINDS) + " |")
    print()
    summaries = {
        "roofline (per generation)": summary("roofline"),
        "roofline (one set for all GPUs)": summary("roofline_all"),
        "datasheet": summary("datasheet"),
    }
    for name, (_, gpu) in holdout.items():
        summaries[name] = summary("holdout", lambda c, g=gpu: c["gpu"] == g)
        summaries[f"  (same GPU, its own generation's fit: {gpu})"] = summary("roofline",
                                                                               lambda c, g=gpu: c["gpu"] == g)
    print("Kernel classes on their own (per-generation constants), median / max %:")
    print("| GPU | model | TP | " + " | ".join(CLASSES) + " |")
    print("|" + " --- |" * (3 + len(CLASSES)))
    for row in rows:
        print(f"| {row['gpu']} | {row['model']} | {row['tp']} | "
              + " | ".join(f"{100 * row['classes'][n]['median']:.0f} / {100 * row['classes'][n]['max']:.0f}"
                           for n in CLASSES) + " |")
    print()
    print("Over the fitted cases (median of the per-case medians / max), %:")
    print("| constants | prefill median / max % | decode | mixed |")
    print("| --- | --- | --- | --- |")
    for name, s in summaries.items():
        print(f"| {name} | " + " | ".join(f"{100 * s[k]['median_of_medians']:.1f} / {100 * s[k]['max']:.0f}"
                                          for k in KINDS) + " |")
    print()
    for name, c in fitted.items():
        print(f"{name:7s} cost {costs[name]:.4f}: " + ", ".join(f"{f}={getattr(c, f):.4g}" for f in NAMES))

    from importlib.metadata import version

    source = {"aiconfigurator_core": version("aiconfigurator-core"), "framework": "vllm",
              "database_versions": sorted({f"{c['gpu']}:{c['database_version']}" for c in cases}),
              "cases": len(cases), "steps": n_samples, "script": "benchmarks/fit_roofline.py"}
    text = format_constants(fitted, source)
    if args.write:
        write_constants(text)
        print("\nwrote FITTED to splitserve/perf/roofline.py")
    else:
        print("\n" + text)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"source": source, "fitted": {k: v.to_dict() for k, v in fitted.items()}, "costs": costs,
           "holdout": {name: {"gpu": gpu, "constants": c.to_dict()} for name, (c, gpu) in holdout.items()},
           "summary": summaries, "rows": rows,
           "grid": {"prefill_L": PREFILL_L, "prefill_H": PREFILL_H, "decode_B": DECODE_B, "decode_C": DECODE_C,
                    "mixed_L": MIXED_L, "mixed_H": MIXED_H, "mixed_B": MIXED_B, "mixed_C": MIXED_C,
                    "min_kv_tokens": MIN_KV_TOKENS}}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
