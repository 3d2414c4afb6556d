"""dLLM-Serve evaluation on this machine's CPU with the tiny trained LLaDA (issue 15).

Two parts, side by side in one run:

* `cpu` — throughput and latency (medians over --repeats runs, the two systems interleaved)
  of the diffusion engine under Poisson arrivals, the
  phase-multiplexed scheduler (dLLM-Serve §4.4) against the static request-level baseline
  (Fast-dLLM's dual cache at the largest batch whose Refresh fits the same token budget),
  same model, same requests, same dual cache. The rates are fractions of the saturation
  throughput measured first (every request at t = 0, phase-multiplexed).
* `quality` — exact-match accuracy of the digit-reversal task (workers/diffusion/tiny_task.py)
  against the KV retention ratio r, head-centric sparse KV (§4.5) against the uniform
  selection of Sparse-dLLM, on held-out problems.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/dllm_eval.py --model DIR

`DIR` is the trained model (`scripts/train_tiny_dllm.py --out DIR`). The table goes to
stdout, JSON and plots to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from common import REPO, percentile_round_rank

import torch  # noqa: E402

from splitserve.core import SamplingParams, StageKey  # noqa: E402
from workers.diffusion import tiny_task  # noqa: E402
from workers.engine import LLM  # noqa: E402


# What times this benchmark's steps (every dLLM report says it; benchmarks/dllm_emulated.py's are
# virtual time on a perf model): the real engine and model, on this machine's CPU.
TIMING = "measured wall clock of the real diffusion engine and the tiny LLaDA on this CPU (no perf model)"


def serve(model: Path, prompts: list[list[int]], arrivals: list[float], params: SamplingParams, policy: str,
          budget: int, static_batch: int, threads: int) -> dict:
    """Run the engine over requests arriving at `arrivals` (seconds from the start, wall clock)."""
    llm = LLM(str(model), diffusion_policy=policy, max_num_batched_tokens=budget, static_batch_size=static_batch,
              num_threads=threads, max_num_seqs=256)
    engine = llm.engine
    done: dict[int, float] = {}
    first: dict[int, float] = {}
    tokens = 0
    start = time.perf_counter()
    admitted = 0
    while admitted < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while admitted < len(prompts) and arrivals[admitted] <= now:
            engine.add_request(StageKey(str(admitted)), prompts[admitted], SamplingParams(**vars(params)))
            admitted += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[admitted] - now))  # idle until the next arrival
            continue
        for event in engine.step():
            index = int(event.key.request_id)
            stamp = time.perf_counter() - start
            first.setdefault(index, stamp)
            tokens += len(event.token_ids)
            if event.finish_reason:
                done[index] = stamp
    makespan = time.perf_counter() - start
    latency = [done[i] - arrivals[i] for i in range(len(prompts))]
    first_block = [first[i] - arrivals[i] for i in range(len(prompts))]
    return {"policy": policy, "requests": len(prompts), "makespan_s": makespan, "output_tok_s": tokens / makespan,
            "req_s": len(prompts) / makespan, "latency_mean_s": statistics.mean(latency),
            "latency_p50_s": percentile_round_rank(latency, 50), "latency_p99_s": percentile_round_rank(latency, 99),
            "latency_std_s": statistics.pstdev(latency), "first_block_p50_s": percentile_round_rank(first_block, 50)}


def cpu_part(args, prompts: list[list[int]]) -> list[dict]:
    params = SamplingParams(max_tokens=tiny_task.GEN_LENGTH, block_length=args.block_length, steps=args.steps,
                            temperature=0.0)
    length = max(len(p) for p in prompts) + tiny_task.GEN_LENGTH
    static_batch = max(1, args.budget // length)  # the largest batch whose Refresh fits the budget
    common = dict(budget=args.budget, static_batch=static_batch, threads=args.threads)
    serve(args.model, prompts[:8], [0.0] * 8, params, "phase_multiplexed", **common)  # warm-up
    saturation = serve(args.model, prompts, [0.0] * len(prompts), params, "phase_multiplexed", **common)
    capacity = saturation["req_s"]
    rows = []
    for fraction in args.rates:
        rate = fraction * capacity
        rng = random.Random(7)
        clock, arrivals = 0.0, []
        for _ in prompts:
            clock += rng.expovariate(rate)
            arrivals.append(clock)
        runs: dict[str, list[dict]] = {"static": [], "phase_multiplexed": []}
        for _ in range(args.repeats):  # the two systems interleaved, the same arrivals each time
            for policy in runs:
                runs[policy].append(serve(args.model, prompts, arrivals, params, policy, **common))
        for policy, results in runs.items():
            row = {key: statistics.median([r[key] for r in results]) if isinstance(results[0][key], float)
                   else results[0][key]
                   for key in results[0]}
            row.update(rate_req_s=rate, rate_fraction=fraction, static_batch=static_batch, repeats=args.repeats,
                       output_tok_s_runs=[r["output_tok_s"] for r in results])
            rows.append(row)
            print(f"  {policy:18s} rate {rate:6.2f} req/s: {row['output_tok_s']:7.1f} tok/s (median of "
                  f"{args.repeats}), latency mean {row['latency_mean_s']:.2f} s p99 {row['latency_p99_s']:.2f} s",
                  flush=True)
    return rows


def quality_part(args) -> list[dict]:
    problems = tiny_task.problems(args.problems, seed=args.seed)
    rows = []
    for selection in ("head", "uniform"):
        llm = LLM(str(args.model), sparse_kv=selection, num_threads=args.threads, max_num_batched_tokens=8192,
                  max_num_seqs=256)
        for ratio in args.ratios:
            params = SamplingParams(max_tokens=tiny_task.GEN_LENGTH, block_length=args.block_length, steps=args.steps,
                                    temperature=0.0, retention_ratio=ratio, ignore_eos=True)
            outputs = llm.generate([list(p.prompt_ids) for p in problems], params)
            accuracy = tiny_task.accuracy([o.token_ids for o in outputs], problems)
            rows.append({"selection": selection, "retention_ratio": ratio, "accuracy": accuracy,
                         "problems": len(problems)})
            print(f"  {selection:8s} r = {ratio:.2f}: {accuracy:.1%} of {len(problems)}", flush=True)
    return rows


def plots(out_dir: Path, cpu_rows: list[dict], quality_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if cpu_rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for policy, label in (("static", "static batch (Fast-dLLM dual cache)"),
                              ("phase_multiplexed", "phase-multiplexed (dLLM-Serve)")):
            rows = [r for r in cpu_rows if r["policy"] == policy]
            left.plot([r["rate_req_s"] for r in rows], [r["output_tok_s"] for r in rows], marker="o", label=label)
            right.plot([r["rate_req_s"] for r in rows], [r["latency_mean_s"] for r in rows], marker="o", label=label)
        left.set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title="throughput")
        right.set(xlabel="arrival rate (req/s)", ylabel="mean latency (s)", title="latency")
        left.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "dllm_eval_cpu.png", dpi=110)
    if quality_rows:
        fig, ax = plt.subplots(figsize=(5, 4))
        for selection, label in (("head", "head-centric (dLLM-Serve)"), ("uniform", "uniform (Sparse-dLLM)")):
            rows = [r for r in quality_rows if r["selection"] == selection]
            ax.plot([r["retention_ratio"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o",
                    label=label)
        ax.set(xlabel="KV retention ratio r", ylabel="exact-match accuracy (%)", title="digit reversal, held out")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "dllm_eval_quality.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the trained tiny LLaDA directory")
    ap.add_argument("--parts", default="cpu,quality")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.8, 1.0, 1.5],
                    help="arrival rates as fractions of the measured saturation throughput")
    ap.add_argument("--repeats", type=int, default=3, help="runs per system and rate (medians reported)")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens (query tokens per step)")
    ap.add_argument("--block-length", type=int, default=4)
    ap.add_argument("--steps", type=int, default=tiny_task.GEN_LENGTH)
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")],
                    default=[1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1])
    ap.add_argument("--seed", type=int, default=20261125)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "dllm_eval")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    prompts = [list(p.prompt_ids) for p in tiny_task.problems(args.requests, seed=args.seed + 1)]
    print(f"step times: {TIMING} ({platform.processor() or platform.machine()}, {args.threads} threads)", flush=True)
    cpu_rows = cpu_part(args, prompts) if "cpu" in parts else []
    quality_rows = quality_part(args) if "quality" in parts else []
    if cpu_rows:
        print("\n| system | rate (req/s) | output tok/s | latency mean / p50 / p99 s | std s | first block p50 s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in cpu_rows:
            print(f"| {r['policy']} | {r['rate_req_s']:.2f} | {r['output_tok_s']:.1f} | {r['latency_mean_s']:.2f} / "
                  f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} | {r['latency_std_s']:.2f} | "
                  f"{r['first_block_p50_s']:.2f} |")
        for fraction in args.rates:
            pair = {r["policy"]: r for r in cpu_rows if r["rate_fraction"] == fraction}
            print(f"rate {fraction:.2f}x: throughput {pair['phase_multiplexed']['output_tok_s'] / pair['static']['output_tok_s']:.2f}x, "
                  f"mean latency {pair['static']['latency_mean_s'] / pair['phase_multiplexed']['latency_mean_s']:.2f}x lower")
    if quality_rows:
        print("\n| retention r | head-centric | uniform |")
        print("| --- | --- | --- |")
        for ratio in args.ratios:
            pair = {r["selection"]: r for r in quality_rows if r["retention_ratio"] == ratio}
            print(f"| {ratio:.2f} | {pair['head']['accuracy']:.1%} | {pair['uniform']['accuracy']:.1%} |")
    (args.out_dir / "dllm_eval.json").write_text(json.dumps({
        "timing": TIMING,
        "cpu": cpu_rows, "quality": quality_rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "torch": torch.__version__}}, indent=1))
    plots(args.out_dir, cpu_rows, quality_rows)


if __name__ == "__main__":
    main()
