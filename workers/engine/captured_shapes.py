"""Captured step shapes in the model runner (LAPS §3.1): a batch of short prefills padded to a bucket.

LAPS batches short (re-)prefills into a grid of `(tokens, batch)` shapes (`ShapeGrid`,
chosen by the `laps` batch policy) so that a GPU can replay a CUDA graph captured for the
shape instead of launching every kernel again. A graph replays fixed shapes at fixed
addresses, so a step must first be padded to its bucket: every request's chunk to the
length bucket L, the batch to the batch bucket B, B·L tokens in all.

Padding here keeps every real token's computation exactly what it was:

* the real chunks keep their place, offsets and attention (each real chunk still attends
  over its own keys only); the pad tokens follow them, as dummy chunks of at most L tokens
  that attend only to themselves (`context_len == query_len`: no cache read);
* every pad token's KV goes to one scratch block past the blocks the block manager owns,
  so no sequence's cache is touched;
* the logits rows sampled are the real ones (`logits_indices` unchanged).

What changes is the row count M of every linear layer (B·L instead of the real tokens): a
BLAS may pick another kernel for another M and round differently, so the real rows are
equal to float32 rounding, bit-identical only where the kernel does not change
(`benchmarks/captured_shapes_cpu.py` on SmolLM2: bit-exact in 4 of 6 buckets, otherwise
max |Δlogit| ≤ 4e-5, the same greedy tokens; the same holds for any change of batch
composition, padded or not). `tests/integration/test_captured_shapes.py` checks the padded
step against the unpadded one on the CPU: logits, tokens, and that no real KV is touched.

On the CPU the padded shape is executed eagerly: it costs the pad tokens' compute and buys
nothing (no launch overhead to save), so it is off by default (`captured_shapes`) and is
there to run the same bucketing and padding a CUDA capture replays. CUDA graph capture and
replay per bucket (static input buffers of B·L tokens, one graph per bucket, replay on a
hit, eager on a miss) is not built: it cannot be tested on this machine.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from splitserve.core.shapes import ShapeGrid
from workers.engine.attention import PrefillChunk

__all__ = ["padded_shape", "pad_prefill_batch"]

PAD_TOKEN_ID = 0


def padded_shape(grid: ShapeGrid, num_decode_tokens: int, chunk_lens: list[int]) -> tuple[int, int] | None:
    """The `(L, B)` bucket of a step of prefill chunks only; None when it has decodes or fits none."""
    if num_decode_tokens or not chunk_lens:
        return None
    return grid.padded(chunk_lens)


def pad_prefill_batch(batch, grid: ShapeGrid, scratch_block: int, block_size: int):
    """`batch` (a `PreparedBatch`) padded to its captured shape, or None when it has none.

    The pad tokens form dummy chunks of at most L tokens after the real ones; their KV is
    written to block `scratch_block` (which no sequence owns)."""
    meta = batch.meta
    shape = padded_shape(grid, meta.num_decode_tokens, [c.query_len for c in meta.prefills])
    if shape is None:
        return None
    length, depth = shape
    real = batch.input_ids.shape[0]
    pad = length * depth - real
    if pad <= 0:
        return batch
    device = batch.input_ids.device
    pieces = [min(length, pad - start) for start in range(0, pad, length)]
    positions = torch.cat([torch.arange(n, device=device) for n in pieces])
    scratch_slots = scratch_block * block_size + positions % block_size
    scratch_table = torch.tensor([scratch_block], dtype=torch.long, device=device)
    chunks = list(meta.prefills)
    offset = real
    for n in pieces:
        chunks.append(PrefillChunk(offset, n, n, scratch_table))
        offset += n
    slot_mapping = torch.cat([meta.slot_mapping, scratch_slots])
    padded_meta = replace(meta, slot_mapping=slot_mapping, slot_blocks=slot_mapping // block_size,
                          slot_offsets=slot_mapping % block_size, prefills=chunks)
    return replace(batch, input_ids=torch.cat([batch.input_ids, torch.full((pad,), PAD_TOKEN_ID, dtype=torch.long,
                                                                            device=device)]),
                   positions=torch.cat([batch.positions, positions]), meta=padded_meta)
