"""dLLM-Serve evaluation on emulated GPUs: RTX 4090 and L40S x LLaDA-8B (issue 15; issue 34 item 5).

The real `DiffusionEngine` (scheduler, admission, block events) over the emulated runner
(`workers/diffusion/emulated.py`) on a **virtual clock** (a discrete-event run: no sleeping, a
run takes the control plane's time only). Each step's time comes from `--perf-backends`
(`splitserve/core/diffusion_perf.py`), each a separate evaluation, reported side by side:

* `datasheet` — the roofline of datasheet numbers (every result before issue 34);
* `auto` — the measured kernel tables (NVIDIA aiconfigurator's per-op timings on the real GPU,
  `MeasuredDiffusionPerfModel`) where the GPU is covered (L40S; also A100, H100), else the
  datasheet roofline with a warning (RTX 4090: then it is the same run as `datasheet` and is
  not repeated); `aiconfigurator` — measured only (an error where not covered).

Systems, the same requests (dLLM-Serve Table 4's four):

* `static` — Fast-dLLM's dual cache: request-level static batches (a new batch only when the
  previous one drained), no logit decomposition (a Refresh materialises every position's
  logits), padded to the batch's longest sequence, at the largest batch whose Refresh step
  fits beside the weights (§6.1's "maximum static batch size that fits");
* `dllm_cache` — dLLM-Cache (prompt refreshed every 100 steps, response every 7, Table 3;
  25% of the response recomputed in between): the same static batching, its feature cache
  (K, V, attention and MLP outputs: twice LLaDA's KV per token) and its LM head over every
  position at every step;
* `sparse_dllm` — Sparse-dLLM (retention 0.5, Table 3): the same static batching; two full
  forwards per block (no cache, then the cache built and evicted to half the context), the
  rest of the block against the retained context; its cache half the context;
* `dllm_serve` — phase-multiplexed scheduling (§4.4) within max_num_batched_tokens (Table 3:
  4,000 on the 4090, 16,384 on the L40S), logit decomposition (max_num_logits 2,048) and the
  KV pool of the logit-aware profile (§4.2-§4.3); `dllm_serve_sparse` adds the head-centric
  sparse KV at r = 0.5 (Table 3's full configuration, what Table 4 measures).

Workload (Table 3): 256 generated tokens, 256 steps, blocks of 32 (one Refresh and 31 Reuse
steps per block), greedy. Prompt lengths are log-normal (median --prompt-median, sigma
--prompt-sigma) clipped to [--prompt-min, --prompt-max] (seeded): the paper gives no length
statistics for its LiveBench / OSC / BurstGPT mixes; this is a chat/summarisation-like mix.
The static batch is sized for the longest request the distribution allows (prompt-max + 256).

First each system's saturation throughput (every request at t = 0); then Poisson arrivals at
fractions (--rates) of dLLM-Serve's saturation rate (Fast-dLLM and dLLM-Serve), and at
--paper-rate req/s (Table 4's 1.0 req/s, every system); medians over --seeds (each seed draws
its own prompt lengths and arrival times). At saturation, ablations split the gain:
`static_unpadded` (the baseline without padding), `static_logit_aware` (a static batch
sized with decomposed logits: the memory effect alone), `static_fp64_logits`, a sensitivity
of the baseline's memory (the batch sized with Fast-dLLM's own float64 softmax: 18 bytes per
logit element at the peak instead of the headline's fp32 8), and `sparse_dllm_batch1`
(Sparse-dLLM's public cache filter indexes with `keep_indices.squeeze(0)`, which only works
for a batch of one). `--sensitivity` adds, on the measured backend, the saturation runs with
the Reuse attention timed per request by the prefill-attention table instead of the batched
decode-attention table.

    flock /tmp/splitserve-bench.lock nice -n 15 .venv/bin/python benchmarks/dllm_emulated.py --sensitivity

Tables to stdout (each says which backend timed it), JSON and plot to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common import REPO, percentile_round_rank

from splitserve.core import SamplingParams, StageKey  # noqa: E402
from splitserve.core.diffusion_perf import LOGIT_BYTES_PER_ELEMENT, diffusion_perf_model  # noqa: E402
from workers.diffusion.emulated import (DiffusionEmulation, VirtualClock, build_emulated_diffusion_engine,  # noqa: E402
                                        dllm_serve_config, static_baseline_config)

GEN_LENGTH, STEPS, BLOCK_LENGTH = 256, 256, 32  # dLLM-Serve Table 3
MAX_NUM_LOGITS = 2048  # Table 3: max materialised logits
# Table 3: max batched tokens per GPU (A100 / H100: the L40S's, not in the paper)
MAX_BATCHED_TOKENS = {"RTX4090": 4000, "L40S": 16384, "A100": 16384, "H100": 16384}
SPARSE_RETENTION = 0.5  # Table 3: the retention ratio (dLLM-Serve and Sparse-dLLM)
# Table 4's systems (the Poisson rates run the first and the fourth: Fast-dLLM and dLLM-Serve).
SYSTEMS = ("static", "dllm_cache", "sparse_dllm", "dllm_serve", "dllm_serve_sparse")
RATE_SYSTEMS = ("static", "dllm_serve")
# `<baseline>_b<N>`: the baseline at a static batch of N instead of the largest that fits.
ABLATIONS = ("static_unpadded", "static_logit_aware", "static_fp64_logits", "static_b1", "dllm_cache_b1",
             "sparse_dllm_b1")
BASELINES = ("static", "dllm_cache", "sparse_dllm")
SENSITIVITY = "reuse_prefill"  # the measured backend with the per-request prefill mapping of Reuse attention
# Fast-dLLM's get_transfer_index keeps the bf16 logits and takes a float64 softmax of a float64
# copy: 2 + 8 + 8 bytes per logit element at its peak (the headline uses fp32: 8).
FAST_DLLM_LOGIT_BYTES = 18
LABELS = {"static": "Fast-dLLM (static dual cache)", "dllm_serve": "dLLM-Serve (phase-mux + logit-aware)",
          "dllm_cache": "dLLM-Cache (static, Kp 100 / Kr 7 / rho 0.25)",
          "sparse_dllm": "Sparse-dLLM (static, r = 0.5)",
          "static_unpadded": "Fast-dLLM, unpadded", "static_logit_aware": "Fast-dLLM, logit-aware memory",
          "dllm_serve_sparse": "dLLM-Serve + sparse KV r = 0.5",
          "static_fp64_logits": "Fast-dLLM, float64 softmax (18 B/logit)"}


def label(system: str) -> str:
    base, batch = split_batch(system)
    if batch is None:
        return LABELS[system]
    name = LABELS[base].split(" (")[0]
    return f"{name}, static batch {batch}" + (" (Sparse-dLLM's public code runs batch 1 only)"
                                              if base == "sparse_dllm" and batch == 1 else "")


def split_batch(system: str) -> tuple[str, int | None]:
    """("sparse_dllm", 1) for "sparse_dllm_b1"; (system, None) for a system at its largest batch."""
    base, _, tail = system.rpartition("_b")
    if base in BASELINES and tail.isdigit():
        return base, int(tail)
    return system, None

SHORT_LABELS = {"static": "Fast-dLLM", "dllm_serve": "dLLM-Serve", "dllm_cache": "dLLM-Cache",
                "dllm_serve_sparse": "dLLM-Serve + sparse KV",
                "sparse_dllm": "Sparse-dLLM", "static_logit_aware": "Fast-dLLM,\nlogit-aware",
                "static_fp64_logits": "Fast-dLLM,\nfp64 logits"}
# dLLM-Serve's Table 4 (L40S, 1.0 req/s): throughput tok/s and mean latency s per dataset; its
# "dLLM-Serve (Ours)" runs Table 3's configuration, the sparse KV at r = 0.5 included.
PAPER_L40S = {
    "LiveBench": {"dllm_cache": (32.52, 419.17), "sparse_dllm": (32.26, 435.18), "static": (56.46, 241.19),
                  "dllm_serve_sparse": (90.17, 218.50)},
    "Burst": {"dllm_cache": (33.07, 6766.53), "sparse_dllm": (34.23, 6466.96), "static": (61.26, 3158.38),
              "dllm_serve_sparse": (106.95, 1551.40)},
    "OSC": {"dllm_cache": (32.62, 6898.20), "sparse_dllm": (32.87, 6791.42), "static": (58.23, 3408.36),
            "dllm_serve_sparse": (94.32, 1849.79)},
}
# §6.2 / Figure 3 (RTX 4090, Burst, peak): the only 4090 numbers the text gives.
PAPER_4090 = {"static": 42.4, "dllm_serve_sparse": 76.6}


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_median: int
    prompt_sigma: float
    prompt_min: int
    prompt_max: int

    @property
    def max_seq_len(self) -> int:
        return self.prompt_max + GEN_LENGTH

    def prompt_lengths(self, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [min(self.prompt_max, max(self.prompt_min, round(rng.lognormvariate(math.log(self.prompt_median),
                                                                                   self.prompt_sigma))))
                for _ in range(self.requests)]


def system_engine(system: str, gpu: str, workload: Workload, backend: str = "datasheet"):
    """(engine, clock, memory plan, retention ratio) of one system on a fresh virtual clock;
    `backend` times the steps (`reuse_prefill`: the measured backend, Reuse attention per request
    on the prefill table)."""
    clock = VirtualClock()
    timing = dict(perf_backend="aiconfigurator", reuse_attention="prefill") if backend == SENSITIVITY else \
        dict(perf_backend=backend)
    system, fixed_batch = split_batch(system)
    retention = SPARSE_RETENTION if system in ("dllm_serve_sparse", "sparse_dllm") else 1.0
    if system.startswith("dllm_serve"):
        emulation = DiffusionEmulation(gpu, **timing)
        config, plan = dllm_serve_config(emulation, max_num_batched_tokens=MAX_BATCHED_TOKENS[gpu],
                                         max_num_logits=MAX_NUM_LOGITS)
    else:
        method = {"dllm_cache": "dllm_cache", "sparse_dllm": "sparse_dllm"}.get(system, "dual")
        emulation = DiffusionEmulation(gpu, logit_decomposition=system == "static_logit_aware",
                                       pad_to_longest=system != "static_unpadded" and system != "static_logit_aware",
                                       logit_bytes_per_element=FAST_DLLM_LOGIT_BYTES
                                       if system == "static_fp64_logits" else LOGIT_BYTES_PER_ELEMENT,
                                       method=method, **timing)
        config, plan = static_baseline_config(emulation, workload.max_seq_len, block_length=BLOCK_LENGTH,
                                              max_num_logits=MAX_NUM_LOGITS, retention_ratio=retention,
                                              batch_size=fixed_batch)
    return build_emulated_diffusion_engine(config, emulation, clock), clock, plan, retention


def serve(system: str, gpu: str, workload: Workload, prompt_lengths: list[int], arrivals: list[float],
          backend: str = "datasheet") -> dict:
    """One discrete-event run: requests join at their arrival times on the virtual clock."""
    engine, clock, _, retention = system_engine(system, gpu, workload, backend)
    params = dict(max_tokens=GEN_LENGTH, block_length=BLOCK_LENGTH, steps=STEPS, temperature=0.0,
                  retention_ratio=retention)
    done: dict[int, float] = {}
    first: dict[int, float] = {}
    tokens = admitted = 0
    wall = time.perf_counter()
    while admitted < len(arrivals) or engine.has_unfinished():
        while admitted < len(arrivals) and arrivals[admitted] <= clock.now:
            prompt = [1 + (admitted + i) % 1000 for i in range(prompt_lengths[admitted])]
            engine.add_request(StageKey(str(admitted)), prompt, SamplingParams(**params))
            admitted += 1
        if not engine.has_unfinished():
            clock.advance_to(arrivals[admitted])  # idle until the next arrival
            continue
        before = clock.now
        for event in engine.step():
            index = int(event.key.request_id)
            first.setdefault(index, clock.now)
            tokens += len(event.token_ids)
            if event.finish_reason:
                done[index] = clock.now
        if clock.now == before:
            raise RuntimeError(f"{system}: a step ran nothing with requests unfinished")
    makespan = clock.now
    latency = [done[i] - arrivals[i] for i in range(len(arrivals))]
    first_block = [first[i] - arrivals[i] for i in range(len(arrivals))]
    stats = engine.runner.stats
    return {"system": system, "gpu": gpu, "backend": backend, "timed_by": engine.runner.perf.describe(),
            "requests": len(arrivals), "makespan_s": makespan,
            "output_tokens": tokens, "output_tok_s": tokens / makespan, "req_s": len(arrivals) / makespan,
            "latency_mean_s": statistics.mean(latency), "latency_p50_s": percentile_round_rank(latency, 50),
            "latency_p99_s": percentile_round_rank(latency, 99), "latency_std_s": statistics.pstdev(latency),
            "first_block_p50_s": percentile_round_rank(first_block, 50), "steps": stats.steps,
            "compute_bound_share": stats.compute_bound_steps / max(1, stats.steps),
            "busy_share": stats.busy_s / makespan, "peak_logit_rows": stats.peak_logit_rows,
            "mean_batch": (stats.refresh_entries + stats.reuse_entries) / max(1, stats.steps),
            "static_batch": engine.scheduler.config.static_batch_size
            if engine.scheduler.config.policy == "static" else None,
            "wall_s": time.perf_counter() - wall}


def poisson(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    clock, arrivals = 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    return arrivals


def run_seed(gpu: str, workload: Workload, seed: int, fractions: list[float], backend: str,
             paper_rate: float | None, sweep: tuple[str, ...] = ()) -> list[dict]:
    """Every run of one GPU, one backend and one seed: the saturation runs (`sweep`: more
    baselines at fixed batches), then the Poisson rates."""
    lengths = workload.prompt_lengths(seed)
    rows = []
    burst = [0.0] * workload.requests
    saturation = {}
    systems = SYSTEMS + ABLATIONS + sweep if backend != SENSITIVITY else SYSTEMS
    for system in systems:
        try:
            row = serve(system, gpu, workload, lengths, burst, backend)
        except ValueError as exc:  # a fixed static batch larger than the largest that fits
            if split_batch(system)[1] is None or "does not fit" not in str(exc):
                raise
            continue
        row.update(rate="saturation", rate_fraction=None, rate_req_s=None, seed=seed)
        saturation[system] = row
        rows.append(row)
    if backend == SENSITIVITY:
        return rows
    capacity = saturation["dllm_serve"]["req_s"]
    for fraction in fractions:
        arrivals = poisson(fraction * capacity, workload.requests, seed * 1000 + round(fraction * 100))
        for system in RATE_SYSTEMS:
            row = serve(system, gpu, workload, lengths, arrivals, backend)
            row.update(rate=f"{fraction:g}x", rate_fraction=fraction, rate_req_s=fraction * capacity, seed=seed)
            rows.append(row)
    if paper_rate:
        arrivals = poisson(paper_rate, workload.requests, seed * 1000 + 999)
        for system in SYSTEMS:
            row = serve(system, gpu, workload, lengths, arrivals, backend)
            row.update(rate=f"{paper_rate:g} req/s", rate_fraction=None, rate_req_s=paper_rate, seed=seed)
            rows.append(row)
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (backend, gpu, rate, system): the median of every number over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["gpu"], row["rate"], row["system"]), []).append(row)
    out = []
    for (backend, gpu, rate, system), group in groups.items():
        merged = {"backend": backend, "gpu": gpu, "rate": rate, "system": system, "seeds": [r["seed"] for r in group]}
        for key, value in group[0].items():
            if key in merged or key == "seed":
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
                merged[key] = statistics.median(r[key] for r in group)
            else:
                merged[key] = value
        merged["output_tok_s_runs"] = [r["output_tok_s"] for r in group]
        out.append(merged)
    return out


def memory_table(gpus: list[str], workload: Workload) -> dict:
    plans = {}
    for gpu in gpus:
        plans[gpu] = {}
        for system in ("static", "dllm_cache", "sparse_dllm", "dllm_serve", "static_logit_aware",
                       "static_fp64_logits"):
            _, _, plan, _ = system_engine(system, gpu, workload)
            plans[gpu][system] = {**plan.to_dict(),
                                  "kv_capacity_requests_mean": plan.kv_capacity_tokens
                                  / (workload.prompt_median + GEN_LENGTH)}
    return plans


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def print_tables(gpus: list[str], rows: list[dict], plans: dict, fractions: list[float], backends: list[str],
                 paper_rate: float | None, timed_by: dict, sweep: tuple[str, ...] = ()) -> list[dict]:
    summary = []
    print("\n### Memory split (GB; datasheet capacity x 0.90; the same under every backend)\n")
    print("| GPU | system | usable | weights | activations | logit peak | guard | cache pool | cache tokens | "
          "static batch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gpu in gpus:
        for system, p in plans[gpu].items():
            print(f"| {gpu} | {LABELS[system]} | {fmt_gb(p['usable_bytes'])} | {fmt_gb(p['weight_bytes'])} | "
                  f"{fmt_gb(p['activation_bytes'])} | {fmt_gb(p['logit_bytes'])} ({p['reserved_logit_rows']} rows) | "
                  f"{fmt_gb(p['guard_bytes'])} | {fmt_gb(p['kv_pool_bytes'])} | {p['kv_capacity_tokens']:,} | "
                  f"{p['static_batch_size'] or '-'} |")
    by_key = {(r["backend"], r["gpu"], r["rate"], r["system"]): r for r in rows}
    for backend in backends:
        bgpus = [g for g in gpus if (backend, g, "saturation", "static") in by_key]
        if not bgpus:
            continue
        print(f"\n### Backend `{backend}`: throughput and latency (medians over seeds; virtual clock)\n")
        for gpu in bgpus:
            print(f"* {gpu}: {timed_by[(backend, gpu)]}")
        print("\n| GPU | rate | system | req/s offered | output tok/s | vs Fast-dLLM | latency mean / p50 / p99 s | "
              "first block p50 s | mean batch | compute-bound steps |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        rates = ["saturation"] + [f"{f:g}x" for f in fractions] + ([f"{paper_rate:g} req/s"] if paper_rate else [])
        for gpu in bgpus:
            for rate in rates:
                base = by_key.get((backend, gpu, rate, "static"))
                if base is None:
                    continue
                systems = SYSTEMS + ABLATIONS + sweep if rate == "saturation" else SYSTEMS
                for system in systems:
                    r = by_key.get((backend, gpu, rate, system))
                    if r is None:
                        continue
                    offered = "burst" if r["rate_req_s"] is None else f"{r['rate_req_s']:.3f}"
                    batch = f" (batch {r['static_batch']:.0f})" if r.get("static_batch") else ""
                    print(f"| {gpu} | {rate} | {label(system)}{batch} | {offered} | {r['output_tok_s']:.1f} | "
                          f"{r['output_tok_s'] / base['output_tok_s']:.2f}x | {r['latency_mean_s']:.0f} / "
                          f"{r['latency_p50_s']:.0f} / {r['latency_p99_s']:.0f} | {r['first_block_p50_s']:.1f} | "
                          f"{r['mean_batch']:.1f} | {r['compute_bound_share']:.0%} |")
                for system in ("dllm_serve", "dllm_serve_sparse"):
                    serve_row = by_key.get((backend, gpu, rate, system))
                    if serve_row is None:
                        continue
                    summary.append({"backend": backend, "gpu": gpu, "rate": rate, "system": system,
                                    "rate_req_s": serve_row["rate_req_s"],
                                    "throughput_ratio": serve_row["output_tok_s"] / base["output_tok_s"],
                                    "mean_latency_ratio": base["latency_mean_s"] / serve_row["latency_mean_s"],
                                    "p99_latency_ratio": base["latency_p99_s"] / serve_row["latency_p99_s"]})
        print(f"\n### Backend `{backend}`: dLLM-Serve against Fast-dLLM's static batch (target: >= 1.6x throughput)\n")
        print("| GPU | rate | system | throughput ratio | mean latency lower by | p99 latency lower by |")
        print("| --- | --- | --- | --- | --- | --- |")
        for x in summary:
            if x["backend"] == backend:
                print(f"| {x['gpu']} | {x['rate']} | {LABELS[x['system']]} | {x['throughput_ratio']:.2f}x | "
                      f"{x['mean_latency_ratio']:.2f}x | {x['p99_latency_ratio']:.2f}x |")
    paper_table(gpus, by_key, backends, paper_rate, sweep)
    return summary


def paper_table(gpus: list[str], by_key: dict, backends: list[str], paper_rate: float | None,
                sweep: tuple[str, ...] = ()) -> None:
    """Table 4's systems: the paper's numbers beside each backend's, at saturation and at Table 4's rate."""
    timings = [b for b in backends if b != SENSITIVITY]
    print("\n### Table 4's systems: the paper beside the emulation (output tok/s; ratios vs Fast-dLLM and vs "
          "Sparse-dLLM, Table 4's base)\n")
    head = "| GPU | system | paper LiveBench / Burst / OSC (vs Sparse-dLLM) |"
    for b in timings + ([SENSITIVITY] if any(k[0] == SENSITIVITY for k in by_key) else []):
        head += f" {b}: saturation (vs Fast / vs Sparse) |"
        if paper_rate and b != SENSITIVITY:
            head += f" {b}: {paper_rate:g} req/s tok/s, mean latency s |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for gpu in gpus:
        for system in SYSTEMS + tuple(a for a in ABLATIONS + sweep if split_batch(a)[1] is not None):
            base = split_batch(system)[0]
            if split_batch(system)[1] is not None and gpu == "L40S":
                paper = "(as above)"
            elif gpu == "L40S":
                paper = " / ".join(f"{PAPER_L40S[d][system][0]:.1f} ({PAPER_L40S[d][system][0] / PAPER_L40S[d]['sparse_dllm'][0]:.2f}x)"
                                   if system in PAPER_L40S[d] else "-" for d in PAPER_L40S)
            elif gpu == "RTX4090" and system in PAPER_4090 and base == system:
                paper = f"Burst peak {PAPER_4090[system]:.1f} ({PAPER_4090[system] / PAPER_4090['static']:.2f}x Fast-dLLM)"
            else:
                paper = "-"
            line = f"| {gpu} | {label(system)} | {paper} |"
            for b in timings + ([SENSITIVITY] if any(k[0] == SENSITIVITY for k in by_key) else []):
                r = by_key.get((b, gpu, "saturation", system))
                fast = by_key.get((b, gpu, "saturation", "static"))
                sparse = by_key.get((b, gpu, "saturation", "sparse_dllm"))
                if r is None:
                    line += " - |" if fast is not None else " (not covered: see the datasheet column) |"
                else:
                    line += (f" {r['output_tok_s']:.1f} ({r['output_tok_s'] / fast['output_tok_s']:.2f}x / "
                             f"{r['output_tok_s'] / sparse['output_tok_s']:.2f}x) |")
                if paper_rate and b != SENSITIVITY:
                    q = by_key.get((b, gpu, f"{paper_rate:g} req/s", system)) if base == system else None
                    line += " - |" if q is None else f" {q['output_tok_s']:.1f}, {q['latency_mean_s']:.0f} |"
            print(line)


def plot(path: Path, gpus: list[str], rows: list[dict], plans: dict, backend: str, timed_by: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [g for g in gpus if any(r["gpu"] == g and r["backend"] == backend for r in rows)]
    if not gpus:
        return
    fig, axes = plt.subplots(len(gpus), 3, figsize=(15, 4.2 * len(gpus)), squeeze=False)
    for gpu, (thr, lat, mem) in zip(gpus, axes):
        mine = [r for r in rows if r["gpu"] == gpu and r["backend"] == backend]
        for system, style, color in (("static", "o--", "C0"), ("dllm_serve", "s-", "C2")):
            points = sorted((r["rate_req_s"], r["output_tok_s"], r["latency_mean_s"], r["latency_p99_s"])
                            for r in mine if r["system"] == system and r["rate_fraction"] is not None)
            xs = [p[0] for p in points]
            thr.plot(xs, [p[1] for p in points], style, color=color, label=LABELS[system])
            lat.plot(xs, [p[2] for p in points], style, color=color, label=f"{LABELS[system]}: mean")
            lat.plot(xs, [p[3] for p in points], style, color=color, alpha=0.4, label=f"{LABELS[system]}: p99")
        for i, system in enumerate(("dllm_cache", "sparse_dllm", "static", "dllm_serve", "dllm_serve_sparse")):
            sat = next((r for r in mine if r["system"] == system and r["rate"] == "saturation"), None)
            if sat is not None:
                thr.axhline(sat["output_tok_s"], color=f"C{i + 3}", lw=0.8, ls=":",
                            label=f"{SHORT_LABELS.get(system, system)} saturation")
        thr.set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title=f"{gpu} x LLaDA-8B: throughput")
        lat.set(xlabel="arrival rate (req/s)", ylabel="latency (s)", yscale="log", title=f"{gpu}: latency")
        thr.legend(fontsize=7)
        lat.legend(fontsize=7)
        parts = (("weights", "weight_bytes", "#888888"), ("activations", "activation_bytes", "#f0a030"),
                 ("logit peak", "logit_bytes", "#d04040"), ("guard", "guard_bytes", "#c0c0c0"),
                 ("cache pool", "kv_pool_bytes", "#3070c0"), ("unused", "unused_bytes", "#ffffff"))
        names = list(plans[gpu])
        bottoms = [0.0] * len(names)
        for label, key, color in parts:
            values = [plans[gpu][n][key] / 1e9 for n in names]
            mem.bar(range(len(names)), values, bottom=bottoms, color=color, edgecolor="black", linewidth=0.5,
                    label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        mem.set_xticks(range(len(names)),
                       [SHORT_LABELS[n] + (f"\nbatch {plans[gpu][n]['static_batch_size']}"
                                           if plans[gpu][n]["static_batch_size"] else "") for n in names], fontsize=7)
        capacity_gb = plans[gpu][names[0]]["usable_bytes"] / 0.9 / 1e9
        mem.set(ylabel="GB", title=f"{gpu}: memory split (0.90 x {capacity_gb:.0f} GB)")
        mem.legend(fontsize=7, loc="lower right")
    what = "; ".join(f"{g}: " + ("measured kernel tables (aiconfigurator)" if "measured" in timed_by[(backend, g)]
                                  else "datasheet roofline, not measured") for g in gpus)
    fig.suptitle(f"dLLM-Serve vs Table 4's baselines, emulated on a virtual clock ({what})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def step_table(gpus: list[str]) -> None:
    """Representative steps timed by the datasheet roofline and by the measured kernel tables
    (both Reuse-attention mappings), with the measured kernel breakdown."""
    from splitserve.core.diffusion import DiffusionBatch, DiffusionParams, DiffusionSequence, DiffusionWork, Phase

    params = DiffusionParams(gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH, steps=STEPS)

    def work(prompt: int, phase: Phase, key: int = 0) -> DiffusionWork:
        seq = DiffusionSequence(str(key), prompt, params, step_in_block=0 if phase is Phase.REFRESH else 1)
        return DiffusionWork(seq, phase, seq.query_tokens("dual"), admitted=False)

    cases = [
        ("Refresh, 1 x 640 tokens, block logits (dLLM-Serve)", [work(384, Phase.REFRESH)], {}),
        ("Refresh, 1 x 640 tokens, all 640 logit rows (baselines)", [work(384, Phase.REFRESH)],
         dict(full_sequence_logits=True)),
        ("Reuse, 1 x 32 queries on 640", [work(384, Phase.REUSE)], {}),
        ("Reuse, 12 x 32 on 1,280 (Fast-dLLM's L40S batch)", [work(1024, Phase.REUSE, i) for i in range(12)], {}),
        ("Refresh, 12 x 1,280, all logits (Fast-dLLM's L40S batch)",
         [work(1024, Phase.REFRESH, i) for i in range(12)], dict(full_sequence_logits=True)),
        ("Reuse, 100 x 32 on 690 (dLLM-Serve)", [work(434, Phase.REUSE, i) for i in range(100)],
         dict(max_num_logits=MAX_NUM_LOGITS)),
        ("Mixed, 20 Refresh x 690 + 80 Reuse (dLLM-Serve)",
         [work(434, Phase.REFRESH, i) for i in range(20)] + [work(434, Phase.REUSE, 100 + i) for i in range(80)],
         dict(max_num_logits=MAX_NUM_LOGITS)),
    ]
    print("| GPU | step | datasheet roofline ms (bound) | measured ms | linear / attention / logits ms | "
          "measured, Reuse on the prefill table ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for gpu in gpus:
        roof = diffusion_perf_model(gpu, backend="datasheet")
        try:
            measured = diffusion_perf_model(gpu, backend="aiconfigurator")
            prefill = diffusion_perf_model(gpu, backend="aiconfigurator", reuse_attention="prefill")
        except ValueError as exc:
            print(f"| {gpu} | (not covered: {exc}) | | | | |")
            continue
        for name, works, options in cases:
            batch = DiffusionBatch(works)
            r, m, p = (x.step_cost(batch, **options) for x in (roof, measured, prefill))
            k = dict(m.kernels)
            print(f"| {gpu} | {name} | {r.seconds * 1e3:.1f} ({r.bound}) | {m.seconds * 1e3:.1f} | "
                  f"{k['linear'] * 1e3:.1f} / {k['attention'] * 1e3:.1f} / {k['logits'] * 1e3:.1f} | "
                  f"{p.seconds * 1e3:.1f} |")
        print(f"<!-- {gpu}: {measured.describe()} -->")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="RTX4090,L40S")
    ap.add_argument("--perf-backends", default="datasheet,auto",
                    help="what times the steps, one evaluation each: datasheet | auto | aiconfigurator")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also the saturation runs on the measured backend with Reuse attention per request on the "
                         "prefill-attention table")
    ap.add_argument("--batch-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="also each baseline at these static batches (saturation), e.g. 2,4,8")
    ap.add_argument("--requests", type=int, default=200, help="requests per run")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.25, 0.5, 0.75, 1.0, 1.5],
                    help="Poisson arrival rates as fractions of dLLM-Serve's saturation rate")
    ap.add_argument("--paper-rate", type=float, default=1.0,
                    help="Table 4's arrival rate (req/s): a Poisson run of every system (0: none)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                    help="one run per system, rate and seed (medians reported)")
    ap.add_argument("--prompt-median", type=int, default=384)
    ap.add_argument("--prompt-sigma", type=float, default=0.5)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=min(6, os.cpu_count() or 1), help="processes (one per job)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "dllm_emulated")
    ap.add_argument("--docs-image", default="",
                    help="where the plot of the last backend is copied ('' to skip: the default)")
    ap.add_argument("--step-table", action="store_true",
                    help="only print representative step times under each backend, and exit")
    args = ap.parse_args()
    gpus = args.gpus.split(",")
    if args.step_table:
        step_table(gpus)
        return
    unknown = [g for g in gpus if g not in MAX_BATCHED_TOKENS]
    if unknown:
        ap.error(f"no max_num_batched_tokens for {unknown}; known: {list(MAX_BATCHED_TOKENS)}")
    workload = Workload(args.requests, args.prompt_median, args.prompt_sigma, args.prompt_min, args.prompt_max)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    backends = args.perf_backends.split(",")
    # Which model times each (backend, GPU); a backend that falls back to the datasheet roofline
    # (auto on an uncovered GPU) is the datasheet run, not repeated.
    timed_by, jobs = {}, []
    sweep = tuple(f"{b}_b{n}" for b in BASELINES for n in args.batch_sweep if f"{b}_b{n}" not in ABLATIONS)
    for backend in backends:
        for gpu in gpus:
            perf = diffusion_perf_model(gpu, backend=backend)
            if perf.backend == "datasheet" and backend != "datasheet" and "datasheet" in backends:
                print(f"{backend} on {gpu}: {perf.describe()} -- the datasheet run stands for it", flush=True)
                continue
            timed_by[(backend, gpu)] = perf.describe()
            jobs += [(gpu, workload, seed, args.rates, backend, args.paper_rate, sweep) for seed in args.seeds]
    if args.sensitivity:
        for gpu in gpus:
            perf = diffusion_perf_model(gpu, backend="auto", reuse_attention="prefill")
            if perf.backend == "aiconfigurator":
                timed_by[(SENSITIVITY, gpu)] = perf.describe()
                jobs += [(gpu, workload, seed, [], SENSITIVITY, None, ()) for seed in args.seeds]
        backends = backends + [SENSITIVITY]
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            runs = [row for rows in pool.map(run_seed, *zip(*jobs)) for row in rows]
    else:
        runs = [row for job in jobs for row in run_seed(*job)]
    rows = medians(runs)
    plans = memory_table(gpus, workload)
    print(f"LLaDA-8B, {args.requests} requests per run, prompts log-normal(median {args.prompt_median}, "
          f"sigma {args.prompt_sigma}) in [{args.prompt_min}, {args.prompt_max}], {GEN_LENGTH} generated tokens, "
          f"{STEPS} steps, blocks of {BLOCK_LENGTH}; seeds {args.seeds}; virtual clock; step times by backend:")
    for (backend, gpu), what in timed_by.items():
        print(f"  {backend} / {gpu}: {what}")
    summary = print_tables(gpus, rows, plans, args.rates, backends, args.paper_rate, timed_by, sweep)
    elapsed = time.perf_counter() - started
    print(f"\n{len(runs)} runs in {elapsed:.1f} s wall")
    (args.out_dir / "dllm_emulated.json").write_text(json.dumps({
        "machine": "virtual clock; step times per backend in timed_by",
        "timed_by": {f"{b}/{g}": what for (b, g), what in timed_by.items()},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "workload": {**vars(workload), "gen_length": GEN_LENGTH, "steps": STEPS, "block_length": BLOCK_LENGTH,
                     "max_num_logits": MAX_NUM_LOGITS, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                     "seeds": args.seeds, "rate_fractions": args.rates, "paper_rate": args.paper_rate,
                     "batch_sweep": args.batch_sweep},
        "paper": {"L40S": PAPER_L40S, "RTX4090": PAPER_4090},
        "memory": plans, "summary": summary, "rows": rows, "runs": runs,
        "host": {"platform": platform.platform(), "python": platform.python_version(), "wall_s": elapsed}},
        indent=1))
    image = None
    for backend in backends:
        if backend == SENSITIVITY:
            continue
        image = args.out_dir / f"dllm_emulated_{backend}.png"
        plot(image, gpus, rows, plans, backend, timed_by)
    if args.docs_image and image is not None and image.exists():
        Path(args.docs_image).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(image, args.docs_image)


if __name__ == "__main__":
    main()
