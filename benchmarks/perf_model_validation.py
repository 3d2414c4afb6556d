"""How far each step-time backend lands from GPU measurements (issue 34, item 4).

Part A, steps: every backend of `splitserve.perf.backends.perf_model_for` (the tabulated
measured data, the roofline(s)) against aiconfigurator's own compiled estimator of whole
steps (`EngineHandle.mixed_step_latency` / `decode_step_latency`, NVIDIA's composition of
the same per-op measurements) on a grid of prefill, decode and mixed steps, for several GPU
x model x TP. Target: within +-20% of the measured database.

Part B, DynaServe's Table 1 (arXiv 2504.09285 §2.4: Qwen2.5-14B on 2 x A100, vLLM, measured):
colocation (round-robin, chunked prefill of 2,048 tokens) and 1P1D on the three shapes, each at
the throughput the paper measured at saturation, simulated in virtual time with each backend:
p50 / p99 TBT, throughput, SLO attainment beside the paper's. Table 1's attainment is against
the 100 ms TBT SLO alone (DistServe's), so here a request meets it when its p99 inter-token gap
<= 100 ms, whatever its TTFT (dynaserve_eval.py also bounds TTFT at 20 s to fail runaway
queues; a Poisson stream at the paper's saturating rate builds such queues on 1P1D's single
prefill worker for P8192, which Table 1's runs at a tuned rate did not). Targets: TBT and throughput
within +-25%, and the same SLO verdict (attainment >= 99% or not).

Part C, Table 1's 1P1D again with the KV received as the paper's baseline receives it (vLLM v0's
PyNccl connector: pulled inside the decode worker's step that first schedules the request, its
batch waiting; `Simulator(kv_receive="blocking")`), over NVLink and PCIe, beside the default
(asynchronous pushes): whether the receive explains the paper's 1P1D p99s.

    .venv/bin/python benchmarks/perf_model_validation.py --out bench-results/perf_model_validation.json

Everything here is virtual time on the named timing data; nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import REPO

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from dynaserve_eval import COMMON, LINK, SLO, system_options  # noqa: E402
from loadgen import arrivals  # noqa: E402
from loadgen.metrics import Slo, summarize  # noqa: E402
from loadgen.runner import arrival_offsets  # noqa: E402
from loadgen.workloads import parse_shape  # noqa: E402
from services.planner.sim_workload import SimRequestSpec  # noqa: E402
from services.planner.simulator import Simulator  # noqa: E402
from splitserve.perf.aiconfigurator import SYSTEMS, hf_config  # noqa: E402
from splitserve.perf.backends import BACKENDS, perf_model_for  # noqa: E402
from splitserve.perf.presets import gpu_spec, model_spec  # noqa: E402

console = Console(width=180)

SETUPS = [("A100", "Qwen2.5-14B", 1), ("H100", "Llama-3-8B", 1), ("H100", "Qwen2.5-32B", 2),
          ("H200", "Llama-3.1-70B", 4), ("L40S", "Llama-3-8B", 1), ("H200", "Mixtral-8x7B", 2)]
PREFILLS = (128, 512, 2048, 8192)
DECODES = ((1, 512), (16, 2048), (64, 4096), (256, 1024))
MIXED = ((256, 16), (512, 64), (2048, 32), (1024, 128))

# DynaServe Table 1: (p50 TBT ms, p99 TBT ms, throughput rps, attainment %) per shape and system.
TABLE1 = {
    "P8192/D32": {"1P1D": (22.70, 58.09, 0.83, 100.00), "coloc-2048": (309.68, 352.93, 1.49, 1.73)},
    "P2048/D512": {"1P1D": (47.00, 65.11, 2.56, 99.83), "coloc-2048": (46.86, 336.81, 2.83, 84.09)},
    "P219/D1467": {"1P1D": (50.63, 74.47, 1.68, 99.95), "coloc-2048": (47.99, 162.67, 2.86, 94.46)},
}


TABLE1_SLO = Slo(ttft_s=float("inf"), itl_s=SLO.itl_s)


# Part A compares kernel sums with aiconfigurator's kernel composition, so it takes the kernel-only
# forms; Part B replays vLLM runs, so it adds the framework's fitted per-step cost
# (`splitserve.perf.framework`) to the measured kernels and to the roofline, beside both kernel sums.
STEP_BACKENDS = ("aiconfigurator-kernels", "roofline-kernels", "datasheet")
TABLE1_BACKENDS = ("aiconfigurator", "aiconfigurator-kernels", "roofline", "datasheet")
assert set(STEP_BACKENDS) | set(TABLE1_BACKENDS) <= set(BACKENDS)


def reference_engine(gpu: str, model: str, tp: int):
    from aiconfigurator_core.sdk.engine import EngineHandle

    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(hf_config(model_spec(model))))
        moe = {"moe_tp_size": tp} if model_spec(model).is_moe else {}  # experts tensor-parallel, as tabulated
        return EngineHandle.compile(d, SYSTEMS[gpu_spec(gpu).name], "vllm", tp_size=tp, **moe)


def part_a() -> list[dict[str, Any]]:
    rows = []
    for gpu, model, tp in SETUPS:
        ref = reference_engine(gpu, model, tp)
        shapes = ([("prefill", n, 0, n) for n in PREFILLS] + [("decode", 0, b, c) for b, c in DECODES]
                  + [("mixed", n, b, n) for n, b in MIXED])
        for backend in STEP_BACKENDS:
            link = LINK if gpu_spec(gpu).nvlink_gbs else "pcie"
            perf = perf_model_for(gpu, model, tp, backend=backend, link=link, check_memory=False)
            for kind, chunk, batch, isl in shapes:
                # aiconfigurator's composition: the chunk is a whole prompt of isl tokens, each
                # decode reads isl + osl // 2 + 1 tokens (osl = 2).
                if kind == "decode":
                    want = ref.decode_step_latency(batch, isl, 2) / 1e3
                    got = perf.decode_time(batch, isl + 2)
                else:
                    want = ref.mixed_step_latency(chunk, batch, isl, 2, 0) / 1e3
                    got = perf.mixed_step_time(chunk, 0, batch, isl + 2)
                rows.append({"gpu": gpu, "model": model, "tp": tp, "backend": backend, "label": perf.label,
                             "kind": kind, "chunk": chunk, "decodes": batch, "context": isl,
                             "measured_ms": want * 1e3, "model_ms": got * 1e3, "rel_err": got / want - 1})
    return rows


TABLE1_KEYS = ("tbt_p50_ms", "tbt_p99_ms", "throughput_rps", "attainment_pct")


def _table1_inputs(shape: str, rate: float, requests_per_rate_s: float, min_requests: int, seed: int):
    """One Table 1 cell's requests and Poisson send times (the same for every backend and variant)."""
    lengths = parse_shape(shape)
    n = max(min_requests, int(rate * requests_per_rate_s))
    items = [SimRequestSpec(f"req-{i}", lengths.prompt_len, lengths.output_len) for i in range(n)]
    return items, arrival_offsets(arrivals.poisson(rate), n, np.random.default_rng([seed, 2]))


def _table1_cell(sim: Simulator, items, offsets, paper: tuple[float, ...]) -> dict[str, Any]:
    """One simulated cell beside the paper's: p50 / p99 TBT, throughput, attainment, same verdict."""
    s = summarize(sim.run(items, offsets).results, TABLE1_SLO)
    got = (s.itl.p50 * 1e3, s.itl.p99 * 1e3, s.request_throughput, s.slo_attainment * 100)
    return {"label": sim.config.perf_model.label, "requests": len(items),
            "paper": dict(zip(TABLE1_KEYS, paper)), "simulated": dict(zip(TABLE1_KEYS, got)),
            "verdict_same": (got[3] >= 99.0) == (paper[3] >= 99.0)}


def part_b(requests_per_rate_s: float, min_requests: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for shape, systems in TABLE1.items():
        for system, paper in systems.items():
            rate = paper[2]
            items, offsets = _table1_inputs(shape, rate, requests_per_rate_s, min_requests, seed)
            for backend in TABLE1_BACKENDS:
                sim = Simulator.from_preset(2, "A100", "Qwen2.5-14B", 1, link=LINK, perf_backend=backend,
                                            **{**COMMON, **system_options(system)})
                rows.append({"shape": shape, "system": system, "backend": backend, "rate": rate,
                             **_table1_cell(sim, items, offsets, paper)})
    return rows


# Part C: Table 1's 1P1D again on the default backend with the KV received as the paper's baseline
# receives it, vLLM v0's PyNccl connector: inside the decode worker's step that first schedules
# the request, its batch waiting (`Simulator(kv_receive="blocking")`), over the testbed's NVLink
# (the paper's §6.1: 600 GB/s between any two GPUs of a server) and, as a bracket, over PCIe.
RECEIVES = (("async", LINK), ("blocking", LINK), ("blocking", "pcie"))


def part_c(requests_per_rate_s: float, min_requests: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for shape, systems in TABLE1.items():
        paper = systems["1P1D"]
        items, offsets = _table1_inputs(shape, paper[2], requests_per_rate_s, min_requests, seed)
        for receive, link in RECEIVES:
            sim = Simulator.from_preset(2, "A100", "Qwen2.5-14B", 1, link=link, perf_backend="aiconfigurator",
                                        kv_receive=receive, **{**COMMON, **system_options("1P1D")})
            prompt_kv_ms = sim.config.perf_model.kv_transfer_time(parse_shape(shape).prompt_len) * 1e3
            rows.append({"shape": shape, "system": "1P1D", "kv_receive": receive, "link": link,
                         "kv_transfer_ms_prompt": prompt_kv_ms, **_table1_cell(sim, items, offsets, paper)})
    return rows


def report_c(c: list[dict[str, Any]]) -> dict[str, Any]:
    t = Table(title="Part C: Table 1's 1P1D with the KV received inside the decode step (vLLM v0's connector) - "
                    "p50 / p99 TBT ms, throughput rps, attainment %", header_style="bold")
    for col in ("shape", "paper", *(f"{r} ({link})" for r, link in RECEIVES)):
        t.add_column(col)
    for shape in TABLE1:
        cells = []
        for receive, link in RECEIVES:
            r = next(x for x in c if x["shape"] == shape and x["kv_receive"] == receive and x["link"] == link)
            s = r["simulated"]
            cells.append(f"{s['tbt_p50_ms']:.1f} / {s['tbt_p99_ms']:.1f} / {s['throughput_rps']:.2f} / "
                         f"{s['attainment_pct']:.1f} (prompt's KV {r['kv_transfer_ms_prompt']:.1f} ms)")
        p = TABLE1[shape]["1P1D"]
        t.add_row(shape, f"{p[0]:.1f} / {p[1]:.1f} / {p[2]:.2f} / {p[3]:.1f}", *cells)
    console.print(t)
    summary = {}
    for receive, link in RECEIVES:
        rows = [x for x in c if x["kv_receive"] == receive and x["link"] == link]
        summary[f"{receive}/{link}"] = {
            "tbt_p99_within_25pct": sum(abs(x["simulated"]["tbt_p99_ms"] / x["paper"]["tbt_p99_ms"] - 1) <= 0.25
                                        for x in rows),
            "tbt_p50_within_25pct": sum(abs(x["simulated"]["tbt_p50_ms"] / x["paper"]["tbt_p50_ms"] - 1) <= 0.25
                                        for x in rows),
            "verdicts_same": sum(x["verdict_same"] for x in rows), "cells": len(rows)}
    console.print(f"1P1D p99 TBT within 25% (of 3): {({k: v['tbt_p99_within_25pct'] for k, v in summary.items()})}")
    return summary


def report(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"steps": {}, "table1": {}}
    t = Table(title="Part A: step times against aiconfigurator's estimator (|relative error|)", header_style="bold")
    for col in ("backend", "kind", "steps", "median", "max", "within 20%"):
        t.add_column(col, justify="left" if col in ("backend", "kind") else "right")
    for backend in STEP_BACKENDS:
        for kind in ("prefill", "decode", "mixed", "all"):
            errs = [abs(r["rel_err"]) for r in a if r["backend"] == backend and kind in (r["kind"], "all")]
            within = sum(e <= 0.2 for e in errs) / len(errs)
            summary["steps"].setdefault(backend, {})[kind] = {"median": statistics.median(errs), "max": max(errs),
                                                              "within_20pct": within}
            t.add_row(backend, kind, str(len(errs)), f"{statistics.median(errs):.1%}", f"{max(errs):.1%}",
                      f"{within:.0%}")
    console.print(t)
    t = Table(title="Part B: DynaServe Table 1 (Qwen2.5-14B, 2 x A100) - paper vs simulated "
                    "(p50 / p99 TBT ms, throughput rps, attainment %)", header_style="bold")
    for col in ("shape", "system", "paper", *TABLE1_BACKENDS):
        t.add_column(col)
    for shape, systems in TABLE1.items():
        for system, paper in systems.items():
            cells = []
            for backend in TABLE1_BACKENDS:
                r = next(x for x in b if x["shape"] == shape and x["system"] == system and x["backend"] == backend)
                s = r["simulated"]
                cells.append(f"{s['tbt_p50_ms']:.1f} / {s['tbt_p99_ms']:.1f} / {s['throughput_rps']:.2f} / "
                             f"{s['attainment_pct']:.1f}" + ("" if r["verdict_same"] else " (verdict differs)"))
            t.add_row(shape, system, f"{paper[0]:.1f} / {paper[1]:.1f} / {paper[2]:.2f} / {paper[3]:.1f}", *cells)
    console.print(t)
    for backend in TABLE1_BACKENDS:
        rows = [r for r in b if r["backend"] == backend]

        def err(key: str) -> list[float]:
            return [abs(r["simulated"][key] / r["paper"][key] - 1) for r in rows]
        summary["table1"][backend] = {
            "tbt_p50_within_25pct": sum(e <= 0.25 for e in err("tbt_p50_ms")) / len(rows),
            "tbt_p99_within_25pct": sum(e <= 0.25 for e in err("tbt_p99_ms")) / len(rows),
            "throughput_within_25pct": sum(e <= 0.25 for e in err("throughput_rps")) / len(rows),
            "verdicts_same": sum(r["verdict_same"] for r in rows) / len(rows),
            "median_abs_err": {k: statistics.median(err(k)) for k in ("tbt_p50_ms", "tbt_p99_ms", "throughput_rps")}}
        s = summary["table1"][backend]
        console.print(f"{backend}: p50 TBT within 25% in {s['tbt_p50_within_25pct']:.0%} of the 6 cells, p99 TBT "
                      f"{s['tbt_p99_within_25pct']:.0%}, throughput {s['throughput_within_25pct']:.0%}, SLO verdicts "
                      f"the same in {s['verdicts_same']:.0%}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table1-seconds", type=float, default=400.0, help="arrivals span per Table 1 cell (s)")
    ap.add_argument("--min-requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "perf_model_validation.json")
    args = ap.parse_args()
    started = time.perf_counter()
    a = part_a()
    b = part_b(args.table1_seconds, args.min_requests, args.seed)
    c = part_c(args.table1_seconds, args.min_requests, args.seed)
    summary = report(a, b)
    summary["table1_1p1d_kv_receive"] = report_c(c)
    doc = {"command": " ".join([".venv/bin/python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
           "produced_by": "virtual time (simulator) on each backend's timing data; no GPU ran",
           "summary": summary, "steps": a, "table1": b, "table1_1p1d_kv_receive": c,
           "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {args.out} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
