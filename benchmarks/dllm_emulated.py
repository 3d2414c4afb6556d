"""dLLM-Serve evaluation on emulated GPUs: RTX 4090 and L40S x LLaDA-8B (issue 15, second part).

The real `DiffusionEngine` (scheduler, admission, block events) over the emulated runner
(`workers/diffusion/emulated.py`): each step's time is the roofline of
`splitserve/diffusion_perf.py` from datasheet numbers, on a **virtual clock** (a discrete-event
run: no sleeping, a run takes the control plane's time only). Two systems, the same requests:

* `static` — the baseline: Fast-dLLM's dual cache, request-level static batches (a new batch
  only when the previous one drained), no logit decomposition (a Refresh materialises every
  position's logits), padded to the batch's longest sequence, at the largest batch whose
  Refresh step fits beside the weights (§6.1's "maximum static batch size that fits").
* `dllm_serve` — phase-multiplexed scheduling (§4.4) within max_num_batched_tokens (Table 3:
  4,000 on the 4090, 16,384 on the L40S), logit decomposition (max_num_logits 2,048) and the
  KV pool of the logit-aware profile (§4.2-§4.3).

Workload (Table 3): 256 generated tokens, 256 steps, blocks of 32 (one Refresh and 31 Reuse
steps per block), greedy. Prompt lengths are log-normal (median --prompt-median, sigma
--prompt-sigma) clipped to [--prompt-min, --prompt-max] (seeded): the paper gives no length
statistics for its LiveBench / OSC / BurstGPT mixes; this is a chat/summarisation-like mix.
The static batch is sized for the longest request the distribution allows (prompt-max + 256).

First each system's saturation throughput (every request at t = 0); then Poisson arrivals at
fractions (--rates) of dLLM-Serve's saturation rate; medians over --seeds (each seed draws
its own prompt lengths and arrival times). At saturation, ablations split the gain:
`static_unpadded` (the baseline without padding), `static_logit_aware` (a static batch
sized with decomposed logits: the memory effect alone), `dllm_serve_sparse` (+ head-centric
sparse KV at r = 0.5, Table 3's full configuration), and `static_fp64_logits`, a sensitivity
of the baseline's memory: the batch sized with Fast-dLLM's own float64 softmax (18 bytes per
logit element at the peak instead of the headline's fp32 8; `splitserve/diffusion_perf.py`).

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/dllm_emulated.py

Tables to stdout, JSON and plot to --out-dir, the plot copied to docs/images/dllm_emulated.png.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splitserve.core import SamplingParams, StageKey  # noqa: E402
from splitserve.diffusion_perf import LOGIT_BYTES_PER_ELEMENT  # noqa: E402
from workers.diffusion.emulated import (DiffusionEmulation, VirtualClock, build_emulated_diffusion_engine,  # noqa: E402
                                        dllm_serve_config, static_baseline_config)

GEN_LENGTH, STEPS, BLOCK_LENGTH = 256, 256, 32  # dLLM-Serve Table 3
MAX_NUM_LOGITS = 2048  # Table 3: max materialised logits
# Table 3: max batched tokens per GPU
MAX_BATCHED_TOKENS = {"RTX4090": 4000, "L40S": 16384}
SPARSE_RETENTION = 0.5  # Table 3: the retention ratio
SYSTEMS = ("static", "dllm_serve")
ABLATIONS = ("static_unpadded", "static_logit_aware", "dllm_serve_sparse", "static_fp64_logits")
# Fast-dLLM's get_transfer_index keeps the bf16 logits and takes a float64 softmax of a float64
# copy: 2 + 8 + 8 bytes per logit element at its peak (the headline uses fp32: 8).
FAST_DLLM_LOGIT_BYTES = 18
LABELS = {"static": "static (Fast-dLLM dual cache)", "dllm_serve": "dLLM-Serve (phase-mux + logit-aware)",
          "static_unpadded": "static, unpadded", "static_logit_aware": "static, logit-aware memory",
          "dllm_serve_sparse": "dLLM-Serve + sparse KV r=0.5",
          "static_fp64_logits": "static, Fast-dLLM's float64 softmax (18 B/logit)"}

SHORT_LABELS = {"static": "static\n(Fast-dLLM)", "dllm_serve": "dLLM-Serve",
                "static_logit_aware": "static,\nlogit-aware", "static_fp64_logits": "static,\nfp64 logits"}


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def system_engine(system: str, gpu: str, workload: Workload):
    """(engine, memory plan, retention ratio) of one system on a fresh virtual clock."""
    clock = VirtualClock()
    if system.startswith("static"):
        emulation = DiffusionEmulation(gpu, logit_decomposition=system == "static_logit_aware",
                                       pad_to_longest=system in ("static", "static_fp64_logits"),
                                       logit_bytes_per_element=FAST_DLLM_LOGIT_BYTES
                                       if system == "static_fp64_logits" else LOGIT_BYTES_PER_ELEMENT)
        config, plan = static_baseline_config(emulation, workload.max_seq_len, block_length=BLOCK_LENGTH,
                                              max_num_logits=MAX_NUM_LOGITS)
    else:
        emulation = DiffusionEmulation(gpu)
        config, plan = dllm_serve_config(emulation, max_num_batched_tokens=MAX_BATCHED_TOKENS[gpu],
                                         max_num_logits=MAX_NUM_LOGITS)
    retention = SPARSE_RETENTION if system == "dllm_serve_sparse" else 1.0
    return build_emulated_diffusion_engine(config, emulation, clock), clock, plan, retention


def serve(system: str, gpu: str, workload: Workload, prompt_lengths: list[int], arrivals: list[float]) -> dict:
    """One discrete-event run: requests join at their arrival times on the virtual clock."""
    engine, clock, _, retention = system_engine(system, gpu, workload)
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
    return {"system": system, "gpu": gpu, "requests": len(arrivals), "makespan_s": makespan,
            "output_tokens": tokens, "output_tok_s": tokens / makespan, "req_s": len(arrivals) / makespan,
            "latency_mean_s": statistics.mean(latency), "latency_p50_s": percentile(latency, 50),
            "latency_p99_s": percentile(latency, 99), "latency_std_s": statistics.pstdev(latency),
            "first_block_p50_s": percentile(first_block, 50), "steps": stats.steps,
            "compute_bound_share": stats.compute_bound_steps / max(1, stats.steps),
            "busy_share": stats.busy_s / makespan, "peak_logit_rows": stats.peak_logit_rows,
            "mean_batch": (stats.refresh_entries + stats.reuse_entries) / max(1, stats.steps),
            "wall_s": time.perf_counter() - wall}


def poisson(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    clock, arrivals = 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    return arrivals


def run_seed(gpu: str, workload: Workload, seed: int, fractions: list[float]) -> list[dict]:
    """Every run of one GPU and one seed: the saturation runs, then the Poisson rates."""
    lengths = workload.prompt_lengths(seed)
    rows = []
    burst = [0.0] * workload.requests
    saturation = {}
    for system in SYSTEMS + ABLATIONS:
        row = serve(system, gpu, workload, lengths, burst)
        row.update(rate="saturation", rate_fraction=None, rate_req_s=None, seed=seed)
        saturation[system] = row
        rows.append(row)
    capacity = saturation["dllm_serve"]["req_s"]
    for fraction in fractions:
        arrivals = poisson(fraction * capacity, workload.requests, seed * 1000 + round(fraction * 100))
        for system in SYSTEMS:
            row = serve(system, gpu, workload, lengths, arrivals)
            row.update(rate=f"{fraction:g}x", rate_fraction=fraction, rate_req_s=fraction * capacity, seed=seed)
            rows.append(row)
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (gpu, rate, system): the median of every number over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["gpu"], row["rate"], row["system"]), []).append(row)
    out = []
    for (gpu, rate, system), group in groups.items():
        merged = {"gpu": gpu, "rate": rate, "system": system, "seeds": [r["seed"] for r in group]}
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
        for system in SYSTEMS + ("static_logit_aware", "static_fp64_logits"):
            _, _, plan, _ = system_engine(system, gpu, workload)
            plans[gpu][system] = {**plan.to_dict(),
                                  "kv_capacity_requests_mean": plan.kv_capacity_tokens
                                  / (workload.prompt_median + GEN_LENGTH)}
    return plans


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def print_tables(gpus: list[str], rows: list[dict], plans: dict, fractions: list[float]) -> list[dict]:
    summary = []
    print("\n### Memory split (GB; datasheet capacity x 0.90)\n")
    print("| GPU | system | usable | weights | activations | logit peak | guard | KV pool | KV tokens | "
          "static batch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gpu in gpus:
        for system, p in plans[gpu].items():
            print(f"| {gpu} | {LABELS[system]} | {fmt_gb(p['usable_bytes'])} | {fmt_gb(p['weight_bytes'])} | "
                  f"{fmt_gb(p['activation_bytes'])} | {fmt_gb(p['logit_bytes'])} ({p['reserved_logit_rows']} rows) | "
                  f"{fmt_gb(p['guard_bytes'])} | {fmt_gb(p['kv_pool_bytes'])} | {p['kv_capacity_tokens']:,} | "
                  f"{p['static_batch_size'] or '-'} |")
    print("\n### Throughput and latency (medians over seeds; virtual clock)\n")
    print("| GPU | rate | system | req/s offered | output tok/s | ratio | latency mean / p50 / p99 s | "
          "first block p50 s | mean batch | compute-bound steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    by_key = {(r["gpu"], r["rate"], r["system"]): r for r in rows}
    for gpu in gpus:
        for rate in ["saturation"] + [f"{f:g}x" for f in fractions]:
            base = by_key[(gpu, rate, "static")]
            for system in SYSTEMS + (ABLATIONS if rate == "saturation" else ()):
                r = by_key[(gpu, rate, system)]
                offered = "burst" if r["rate_req_s"] is None else f"{r['rate_req_s']:.3f}"
                print(f"| {gpu} | {rate} | {LABELS[system]} | {offered} | {r['output_tok_s']:.1f} | "
                      f"{r['output_tok_s'] / base['output_tok_s']:.2f}x | {r['latency_mean_s']:.0f} / "
                      f"{r['latency_p50_s']:.0f} / {r['latency_p99_s']:.0f} | {r['first_block_p50_s']:.1f} | "
                      f"{r['mean_batch']:.1f} | {r['compute_bound_share']:.0%} |")
            serve_row = by_key[(gpu, rate, "dllm_serve")]
            summary.append({"gpu": gpu, "rate": rate, "rate_req_s": serve_row["rate_req_s"],
                            "throughput_ratio": serve_row["output_tok_s"] / base["output_tok_s"],
                            "mean_latency_ratio": base["latency_mean_s"] / serve_row["latency_mean_s"],
                            "p99_latency_ratio": base["latency_p99_s"] / serve_row["latency_p99_s"]})
    print("\n### dLLM-Serve against the static baseline (target: >= 1.6x throughput)\n")
    print("| GPU | rate | throughput ratio | mean latency lower by | p99 latency lower by |")
    print("| --- | --- | --- | --- | --- |")
    for s in summary:
        print(f"| {s['gpu']} | {s['rate']} | {s['throughput_ratio']:.2f}x | {s['mean_latency_ratio']:.2f}x | "
              f"{s['p99_latency_ratio']:.2f}x |")
    return summary


def plot(path: Path, gpus: list[str], rows: list[dict], plans: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(gpus), 3, figsize=(15, 4.2 * len(gpus)), squeeze=False)
    for gpu, (thr, lat, mem) in zip(gpus, axes):
        for system, style, color in (("static", "o--", "C0"), ("dllm_serve", "s-", "C2")):
            points = sorted((r["rate_req_s"], r["output_tok_s"], r["latency_mean_s"], r["latency_p99_s"])
                            for r in rows if r["gpu"] == gpu and r["system"] == system and r["rate_req_s"] is not None)
            xs = [p[0] for p in points]
            thr.plot(xs, [p[1] for p in points], style, color=color, label=LABELS[system])
            lat.plot(xs, [p[2] for p in points], style, color=color, label=f"{LABELS[system]}: mean")
            lat.plot(xs, [p[3] for p in points], style, color=color, alpha=0.4, label=f"{LABELS[system]}: p99")
        thr.set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title=f"{gpu} x LLaDA-8B: throughput")
        lat.set(xlabel="arrival rate (req/s)", ylabel="latency (s)", yscale="log", title=f"{gpu}: latency")
        thr.legend(fontsize=8)
        lat.legend(fontsize=7)
        parts = (("weights", "weight_bytes", "#888888"), ("activations", "activation_bytes", "#f0a030"),
                 ("logit peak", "logit_bytes", "#d04040"), ("guard", "guard_bytes", "#c0c0c0"),
                 ("KV pool", "kv_pool_bytes", "#3070c0"), ("unused", "unused_bytes", "#ffffff"))
        names = list(plans[gpu])
        bottoms = [0.0] * len(names)
        for label, key, color in parts:
            values = [plans[gpu][n][key] / 1e9 for n in names]
            mem.bar(range(len(names)), values, bottom=bottoms, color=color, edgecolor="black", linewidth=0.5,
                    label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        mem.set_xticks(range(len(names)),
                       [SHORT_LABELS[n] + (f"\nbatch {plans[gpu][n]['static_batch_size']}"
                                           if plans[gpu][n]["static_batch_size"] else "") for n in names], fontsize=8)
        capacity_gb = plans[gpu][names[0]]["usable_bytes"] / 0.9 / 1e9
        mem.set(ylabel="GB", title=f"{gpu}: memory split (0.90 x {capacity_gb:.0f} GB)")
        mem.legend(fontsize=7, loc="lower right")
    fig.suptitle("dLLM-Serve vs static Fast-dLLM batch, emulated (virtual clock; roofline from datasheets)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="RTX4090,L40S")
    ap.add_argument("--requests", type=int, default=200, help="requests per run")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75, 1.0, 1.5],
                    help="Poisson arrival rates as fractions of dLLM-Serve's saturation rate")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                    help="one run per system, rate and seed (medians reported)")
    ap.add_argument("--prompt-median", type=int, default=384)
    ap.add_argument("--prompt-sigma", type=float, default=0.5)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=min(6, os.cpu_count() or 1), help="processes (one per GPU x seed)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "dllm_emulated")
    ap.add_argument("--docs-image", default=str(REPO / "docs" / "images" / "dllm_emulated.png"),
                    help="where the plot is copied ('' to skip)")
    args = ap.parse_args()
    gpus = args.gpus.split(",")
    unknown = [g for g in gpus if g not in MAX_BATCHED_TOKENS]
    if unknown:
        ap.error(f"no Table 3 max_num_batched_tokens for {unknown}; known: {list(MAX_BATCHED_TOKENS)}")
    workload = Workload(args.requests, args.prompt_median, args.prompt_sigma, args.prompt_min, args.prompt_max)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    jobs = [(gpu, workload, seed, args.rates) for gpu in gpus for seed in args.seeds]
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            runs = [row for rows in pool.map(run_seed, *zip(*jobs)) for row in rows]
    else:
        runs = [row for job in jobs for row in run_seed(*job)]
    rows = medians(runs)
    plans = memory_table(gpus, workload)
    print(f"LLaDA-8B, {args.requests} requests per run, prompts log-normal(median {args.prompt_median}, "
          f"sigma {args.prompt_sigma}) in [{args.prompt_min}, {args.prompt_max}], {GEN_LENGTH} generated tokens, "
          f"{STEPS} steps, blocks of {BLOCK_LENGTH}; seeds {args.seeds}; virtual clock, roofline from datasheets")
    summary = print_tables(gpus, rows, plans, args.rates)
    elapsed = time.perf_counter() - started
    print(f"\n{len(runs)} runs in {elapsed:.1f} s wall")
    (args.out_dir / "dllm_emulated.json").write_text(json.dumps({
        "machine": "virtual clock; perf model from datasheets (splitserve/diffusion_perf.py)",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "workload": {**vars(workload), "gen_length": GEN_LENGTH, "steps": STEPS, "block_length": BLOCK_LENGTH,
                     "max_num_logits": MAX_NUM_LOGITS, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                     "seeds": args.seeds, "rate_fractions": args.rates},
        "memory": plans, "summary": summary, "rows": rows, "runs": runs,
        "host": {"platform": platform.platform(), "python": platform.python_version(), "wall_s": elapsed}},
        indent=1))
    image = args.out_dir / "dllm_emulated.png"
    plot(image, gpus, rows, plans)
    if args.docs_image:
        Path(args.docs_image).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(image, args.docs_image)


if __name__ == "__main__":
    main()
