"""What LAPS' captured shapes cost on the CPU: a short-prefill step padded to its bucket vs unpadded.

On a GPU the padded `(L, B)` shape is what lets a CUDA graph replay; on the CPU there is no
launch overhead to save, so padding can only cost the pad tokens' compute. This measures it
on the real model (SmolLM2-135M-Instruct, float32), side by side in one run: for batches of
B short prompts (lengths drawn in [4, L]), the forward pass of the unpadded step and of the
same step run as its captured bucket (padded to (L, B), static buffers, one masked attention
call: what a CUDA graph replays), medians over repeats, whether the logits are bit-identical,
how far apart they are otherwise, and whether the sampled (greedy) tokens agree. With
`--compile` the bucket also runs `torch.compile`d (static shapes: compiled once per bucket;
the compile time is reported apart).

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/captured_shapes_cpu.py
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

from common import REPO

import torch  # noqa: E402

from splitserve.core import StageKey, StageSpec  # noqa: E402
from splitserve.model_presets import DEFAULT_PRESET, ensure_preset_model  # noqa: E402
from workers.engine import LLM, SamplingParams  # noqa: E402
from workers.engine.captured_shapes import BucketRunner, build_bucket_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x4,32x8,64x8,128x16", help="LxB buckets to measure")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also run each bucket torch.compile'd")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "captured_shapes_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = ensure_preset_model(DEFAULT_PRESET)
    llm = LLM(str(model), captured_shapes=True, shape_tokens="16,32,64,128", shape_batches="4,8,16",
              max_num_seqs=64, max_num_batched_tokens=4096)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    rows = []
    for text in args.shapes.split(","):
        length, batch = (int(x) for x in text.split("x"))
        lengths = [rng.randint(max(4, length // 2 + 1), length) for _ in range(batch)]
        for i, n in enumerate(lengths):
            ids = tuple(rng.randrange(100, 40000) for _ in range(n))
            engine.add_stage(StageSpec(StageKey(f"{text}-{i}"), ids, SamplingParams(max_tokens=1)))
        out = engine.scheduler.schedule()
        plain = runner.prepare(out.entries)
        step = build_bucket_step(out.entries, runner.shapes, runner.block_size, runner.num_blocks,
                                 runner.max_blocks_per_seq)
        assert step is not None, (text, lengths)
        rows_sampled = torch.tensor(step.sample_rows)
        runners = {"bucket": runner.buckets}
        if args.compile:
            runners["compiled"] = BucketRunner(runner._bucket_forward, runner.block_size, runner.device, "compile")
        times = {name: [] for name in ("unpadded", *runners)}
        row = {"bucket": text, "real_tokens": sum(lengths), "padded_tokens": length * batch}
        with torch.inference_mode():
            reference = runner.model(plain.input_ids, plain.positions, runner.layer_caches, plain.meta,
                                     plain.logits_indices)
            for name, bucket_runner in runners.items():  # first run: warm-up (and compile) apart
                started = time.perf_counter()
                bucket_runner.run(step)
                row[f"{name}_first_ms"] = (time.perf_counter() - started) * 1000
            for _ in range(args.repeats):
                started = time.perf_counter()
                runner.model(plain.input_ids, plain.positions, runner.layer_caches, plain.meta, plain.logits_indices)
                times["unpadded"].append(time.perf_counter() - started)
                for name, bucket_runner in runners.items():
                    started = time.perf_counter()
                    logits = bucket_runner.run(step)[rows_sampled]
                    times[name].append(time.perf_counter() - started)
                    row[f"{name}_bit_exact"] = bool(torch.equal(reference, logits))
                    row[f"{name}_max_abs_logit_diff"] = float((reference - logits).abs().max())
                    row[f"{name}_same_argmax"] = bool(torch.equal(reference.argmax(-1), logits.argmax(-1)))
        for entry in out.entries:
            engine.abort(entry.seq.key)
        engine.step()  # frees the aborted stages' blocks
        for name in times:
            row[f"{name}_ms"] = statistics.median(times[name]) * 1000
        row["ratio"] = row["bucket_ms"] / row["unpadded_ms"]
        if args.compile:
            row["compiled_ratio"] = row["compiled_ms"] / row["unpadded_ms"]
        rows.append(row)
    compiled = " compiled ms (first) | compiled / unpadded |" if args.compile else ""
    print("| bucket L×B | real / padded tokens | unpadded ms | bucket ms | bucket / unpadded | logits bit-exact "
          f"| max abs logit diff | same argmax |{compiled}")
    print("| --- " * (8 + (2 if args.compile else 0)) + "|")
    for r in rows:
        extra = (f" {r['compiled_ms']:.1f} ({r['compiled_first_ms'] / 1000:.0f} s) | {r['compiled_ratio']:.2f}× |"
                 if args.compile else "")
        print(f"| {r['bucket']} | {r['real_tokens']} / {r['padded_tokens']} | {r['unpadded_ms']:.1f} | "
              f"{r['bucket_ms']:.1f} | {r['ratio']:.2f}× | {'yes' if r['bucket_bit_exact'] else 'no'} | "
              f"{r['bucket_max_abs_logit_diff']:.2e} | {'yes' if r['bucket_same_argmax'] else 'no'} |{extra}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                "threads": args.threads, "torch": torch.__version__}}, indent=1))


if __name__ == "__main__":
    main()
