"""What LAPS' captured shapes cost on the CPU: a short-prefill step padded to its bucket vs unpadded.

On a GPU the padded `(L, B)` shape is what lets a CUDA graph replay; on the CPU there is no
launch overhead to save, so padding can only cost the pad tokens' compute. This measures it
on the real model (SmolLM2-135M-Instruct, float32), side by side in one run: for batches of
B short prompts (lengths drawn in [4, L]), the forward pass of the unpadded step and of the
same step padded to (L, B), medians over repeats, whether the logits are bit-identical, how
far apart they are otherwise, and whether the sampled (greedy) tokens agree.
`torch.compile` per bucket is not tried: the model's forward takes per-step Python metadata
(a list of prefill chunks), which would recompile or graph-break on every new batch.

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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from splitserve.core import StageKey, StageSpec  # noqa: E402
from splitserve.model_presets import DEFAULT_PRESET, ensure_preset_model  # noqa: E402
from workers.engine import LLM, SamplingParams  # noqa: E402
from workers.engine.captured_shapes import pad_prefill_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x4,32x8,64x8,128x16", help="LxB buckets to measure")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
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
        padded = pad_prefill_batch(plain, runner.shapes, runner.num_blocks, runner.block_size)
        assert padded is not None, (text, lengths)
        times = {"unpadded": [], "padded": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, b in (("unpadded", plain), ("padded", padded)):
                    started = time.perf_counter()
                    logits = runner.model(b.input_ids, b.positions, runner.layer_caches, b.meta, b.logits_indices)
                    times[name].append(time.perf_counter() - started)
                    if name == "unpadded":
                        reference = logits
                    else:
                        exact = torch.equal(reference, logits)
                        max_diff = float((reference - logits).abs().max())
                        same_argmax = bool(torch.equal(reference.argmax(-1), logits.argmax(-1)))
        for entry in out.entries:
            engine.abort(entry.seq.key)
        engine.step()  # frees the aborted stages' blocks
        row = {"bucket": text, "real_tokens": sum(lengths), "padded_tokens": length * batch,
               "unpadded_ms": statistics.median(times["unpadded"]) * 1000,
               "padded_ms": statistics.median(times["padded"]) * 1000, "bit_exact": exact,
               "max_abs_logit_diff": max_diff, "same_argmax": same_argmax}
        row["ratio"] = row["padded_ms"] / row["unpadded_ms"]
        rows.append(row)
    print("| bucket L×B | real / padded tokens | unpadded ms | padded ms | padded / unpadded | logits bit-exact "
          "| max abs logit diff | same argmax |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['bucket']} | {r['real_tokens']} / {r['padded_tokens']} | {r['unpadded_ms']:.1f} | "
              f"{r['padded_ms']:.1f} | {r['ratio']:.2f}× | {'yes' if r['bit_exact'] else 'no'} | "
              f"{r['max_abs_logit_diff']:.2e} | {'yes' if r['same_argmax'] else 'no'} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                "threads": args.threads, "torch": torch.__version__}}, indent=1))


if __name__ == "__main__":
    main()
