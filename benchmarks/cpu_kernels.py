"""The two CPU kernels of issue 16 against what they replaced, at SmolLM2-135M's shapes.

1. Linear layers: one decode pass over 30 layers' distinct weights (qkv 576→960, o 576→576,
   gate_up 576→3072, down 1536→576) and the LM head (576→49152), so every weight comes from
   memory as in serving, for 1, 32 and 256 rows: torch's `F.linear` (MKL sgemm here),
   oneDNN on the plain weight, and oneDNN on a weight reordered once (what the engine uses,
   workers/engine/cpu_linear.py).
2. Decode attention of a 32-sequence batch (contexts uniform in 8..232 tokens) in every one
   of 30 layers of a block-major paged cache: SDPA over gathered KV (the torch path) vs the
   compiled kernel reading in place (workers/engine/kernels).
3. The per-layer elementwise work for 32, 256 and 2048 rows, 30 layers' worth: RMSNorm with
   the residual add before it, twice per layer, and rotary on q and k (9 + 3 heads of 64),
   as torch ops (the model's fallback) and as the compiled fused kernels.

Best of --repeats, milliseconds per model pass, and the bytes each moved per second.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/cpu_kernels.py --out bench-results/cpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import REPO

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from workers.engine import kernels  # noqa: E402
from workers.engine.attention import AttentionMetadata, _sdpa_decode  # noqa: E402

LAYERS = 30
LINEAR_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per layer
LM_HEAD = (576, 49152)


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def linear_pass(rows_list: list[int], repeats: int) -> list[dict]:
    weights = [[torch.randn(n, k) for k, n in LINEAR_SHAPES] for _ in range(LAYERS)]
    head = torch.randn(LM_HEAD[1], LM_HEAD[0])
    nbytes = (sum(w.numel() for ws in weights for w in ws) + head.numel()) * 4
    pointwise = torch.ops.mkldnn._linear_pointwise
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k, _ in LINEAR_SHAPES}
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] for ws in weights]
        packed_head = torch.ops.mkldnn._reorder_linear_weight(head, 32)

        def run(layer_weights, head_weight, linear) -> None:
            for ws in layer_weights:
                for (k, _), w in zip(LINEAR_SHAPES, ws):
                    linear(inputs[k], w)
            linear(inputs[576], head_weight)

        variants = {
            "F.linear (MKL)": lambda: run(weights, head, torch.nn.functional.linear),
            "oneDNN, plain weight": lambda: run(weights, head, lambda x, w: pointwise(x, w, None, "none", [], "")),
            "oneDNN, reordered weight": lambda: run(packed, packed_head,
                                                    lambda x, w: pointwise(x, w, None, "none", [], "")),
        }
        with torch.inference_mode():
            for name, fn in variants.items():
                seconds = best_of(fn, repeats)
                results.append({"rows": rows, "variant": name, "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9})
    return results


def attention_pass(repeats: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    batch, kv_heads, group, head_dim, block_size = 32, 3, 3, 64, 16
    lens = torch.randint(8, 233, (batch,), generator=gen)
    needed = (-(-lens // block_size)).tolist()
    num_blocks = sum(needed) + 8
    cache = torch.randn(num_blocks, LAYERS, 2, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width, tables, used = max(needed), [], 0
    for need in needed:
        tables.append(order[used:used + need] + [0] * (width - need))
        used += need
    tables = torch.tensor(tables)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen)
    meta = AttentionMetadata(slot_mapping=None, slot_blocks=None, slot_offsets=None, num_decode_tokens=batch,
                             decode_block_tables=tables, decode_context_lens=lens, prefills=[], block_size=block_size)
    views = [cache[:, layer].unbind(1) for layer in range(LAYERS)]
    nbytes = int(lens.sum()) * kv_heads * head_dim * 4 * 2 * LAYERS
    variants = {"SDPA over gathered KV (torch)": lambda k, v: _sdpa_decode(q, k, v, meta, None, 0.125)}
    module = kernels.load()
    if module is not None:
        variants["compiled kernel, in place"] = lambda k, v: module.paged_decode_attention(q, k, v, tables, lens,
                                                                                           0.125, 0)
    results = []
    for name, fn in variants.items():
        seconds = best_of(lambda: [fn(k, v) for k, v in views], repeats)
        results.append({"variant": name, "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9,
                        "kv_mb": nbytes / 1e6})
    return results


def elementwise_pass(rows_list: list[int], repeats: int) -> list[dict]:
    """Two (residual add + RMSNorm) and one rotary of q and k per layer, torch vs fused."""
    from workers.engine.models.llama import RMSNorm, apply_rotary

    module = kernels.load()
    norm = RMSNorm(576, 1e-5)
    results = []
    for rows in rows_list:
        gen = torch.Generator().manual_seed(rows)
        x, residual = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
        qkv = torch.randn(rows, 15 * 64, generator=gen)
        q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
        cos, sin = torch.randn(rows, 1, 64, generator=gen), torch.randn(rows, 1, 64, generator=gen)

        def torch_ops():
            for _ in range(LAYERS):
                norm(x, residual)
                apply_rotary(q, k, (cos, sin))
                norm(x, residual)

        def fused_ops():
            for _ in range(LAYERS):
                module.rms_norm(x, norm.weight, 1e-5, residual)
                module.rotary_inplace(q, k, cos, sin)
                module.rms_norm(x, norm.weight, 1e-5, residual)

        with torch.inference_mode():
            variants = [("torch ops", torch_ops)] + ([("fused kernels", fused_ops)] if module is not None else [])
            for name, fn in variants:
                results.append({"rows": rows, "variant": name, "ms": best_of(fn, repeats) * 1e3})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench-results/cpu_kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    linears = linear_pass([1, 32, 256], args.repeats)
    table = Table(title=f"one pass over SmolLM2-135M's linear weights ({LAYERS} layers + LM head), "
                        f"{args.threads} threads, best of {args.repeats}")
    for col in ("rows", "variant", "ms", "weights GB/s"):
        table.add_column(col, justify="right")
    for r in linears:
        table.add_row(str(r["rows"]), r["variant"], f"{r['ms']:.1f}", f"{r['gb_s']:.1f}")
    console.print(table)
    attention = attention_pass(args.repeats)
    table = Table(title=f"decode attention, 32 sequences x {LAYERS} layers ({attention[0]['kv_mb']:.0f} MB of KV)")
    for col in ("variant", "ms", "KV GB/s"):
        table.add_column(col, justify="right")
    for r in attention:
        table.add_row(r["variant"], f"{r['ms']:.1f}", f"{r['gb_s']:.1f}")
    console.print(table)
    elementwise = elementwise_pass([32, 256, 2048], args.repeats)
    table = Table(title=f"RMSNorm + residual (x2) and rotary, {LAYERS} layers")
    for col in ("rows", "variant", "ms"):
        table.add_column(col, justify="right")
    for r in elementwise:
        table.add_row(str(r["rows"]), r["variant"], f"{r['ms']:.2f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "threads": args.threads, "linear": linears,
                                    "attention": attention, "elementwise": elementwise}, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
