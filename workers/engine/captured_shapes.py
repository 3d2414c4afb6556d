"""Captured step shapes in the model runner (LAPS §3.1): a batch of short prefills run as a fixed shape.

LAPS batches short (re-)prefills into a grid of `(tokens, batch)` shapes (`ShapeGrid`,
chosen by the `laps` batch policy) so that a GPU replays a CUDA graph captured for the
shape instead of launching every kernel again. A graph replays fixed shapes at fixed
addresses, so a step is laid out as a **bucket**: B rows of L tokens (each request's chunk
right-padded to the length bucket L, the batch padded to the batch bucket B with empty
rows), and the keys each row reads as K cache blocks (K: the next power of two holding the
longest context in the step, so a short re-prefill with a long history has a bucket too).
`BucketKey(L, B, K)` names the shape; `build_bucket_step` lays out a step on the host.

`BucketRunner` runs a bucket's forward over **static input buffers**, one set per bucket
(stable pointers: a step's inputs are copied into them, never passed as new tensors), with
one of three executors:

* `cuda_graph` (CUDA): the first step of a bucket runs eagerly on a side stream (warm-up:
  allocator and library handles settle), then the forward over the static buffers is
  captured into a `torch.cuda.CUDAGraph` (all graphs share one memory pool) and replayed;
  every later hit copies its inputs in and replays. A step with no bucket, or past
  `max_buckets` captured graphs, runs eagerly unpadded (a miss). The attention of a bucket
  (`attention.bucket_attention`) is written for capture: every shape comes from (L, B, K),
  no value is read back on the host, the KV write is an index_put over static index buffers.
  This executor cannot run on this machine (no GPU): it is kept to the rules above and shares
  every line but the capture/replay with the CPU executors, which the tests run.
* `eager` (default on the CPU): the same static buffers and the same forward, run directly.
* `compile`: the same, `torch.compile`d once per bucket (static shapes: no recompiles).

What padding keeps: every real token's computation. Pad tokens sit after the real ones in
their row (positions clamped to the row's last real one), write their KV to one scratch
block past the blocks the block manager owns, and their outputs are never read; empty rows
read only the scratch block. What changes is the row count M of every linear layer (B·L
instead of the real tokens) and the attention kernel (one masked batched call instead of one
causal call per chunk): a BLAS may pick another kernel and round differently, so the real
logits equal the unpadded ones to float32 rounding, with the same greedy tokens
(`tests/integration/test_captured_shapes.py`; `benchmarks/captured_shapes_cpu.py` measures
the cost and the differences on the real model).

On the CPU there is no launch overhead to save, so padded execution only costs the pad
tokens' compute; captured shapes are off by default (`captured_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from splitserve.core.shapes import ShapeGrid
from workers.engine.attention import BucketMetadata

__all__ = ["BucketKey", "BucketStep", "BucketRunner", "EXECUTORS", "build_bucket_step", "context_blocks_bucket",
           "padded_shape"]

PAD_TOKEN_ID = 0
EXECUTORS = ("eager", "compile", "cuda_graph")


@dataclass(frozen=True)
class BucketKey:
    """A captured shape: B rows of L tokens reading K cache blocks each."""

    tokens: int  # L
    batch: int  # B
    context_blocks: int  # K


@dataclass
class BucketStep:
    """One step laid out as its bucket, on the host (the runner copies it into the static buffers)."""

    key: BucketKey
    input_ids: torch.Tensor  # [B*L]
    positions: torch.Tensor  # [B*L]
    slot_blocks: torch.Tensor  # [B*L]
    slot_offsets: torch.Tensor  # [B*L]
    block_tables: torch.Tensor  # [B, K]
    context_lens: torch.Tensor  # [B]
    query_starts: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # [B]: each row's last real token (empty rows: their first)
    sample_rows: list[int] = field(default_factory=list)  # rows whose entry samples, in entry order


def padded_shape(grid: ShapeGrid, num_decode_tokens: int, chunk_lens: list[int]) -> tuple[int, int] | None:
    """The `(L, B)` bucket of a step of prefill chunks only; None when it has decodes or fits none."""
    if num_decode_tokens or not chunk_lens:
        return None
    return grid.padded(chunk_lens)


def context_blocks_bucket(needed_blocks: int, min_blocks: int, max_blocks: int) -> int | None:
    """K: the next power of two >= `needed_blocks` (at least `min_blocks`, so a row holds its
    L tokens), capped at `max_blocks` (a sequence's most blocks); None when even that is short."""
    if needed_blocks > max_blocks:
        return None
    blocks = max(1, min_blocks)
    while blocks < needed_blocks:
        blocks *= 2
    return min(blocks, max(max_blocks, min_blocks))


def build_bucket_step(entries: Sequence, grid: ShapeGrid, block_size: int, scratch_block: int,
                      max_blocks: int) -> BucketStep | None:
    """`entries` (the step's `ScheduledEntry`s) laid out as their bucket; None when the step
    has a decode (a single-token entry), no entry, or fits no captured shape."""
    lengths = [e.num_new_tokens for e in entries]
    if not lengths or any(n == 1 for n in lengths):
        return None
    shape = grid.padded(lengths)
    if shape is None:
        return None
    length, batch = shape
    contexts = [e.start + e.num_new_tokens for e in entries]
    blocks = context_blocks_bucket(-(-max(contexts) // block_size), -(-length // block_size), max_blocks)
    if blocks is None:
        return None
    key = BucketKey(length, batch, blocks)
    input_ids = torch.full((batch, length), PAD_TOKEN_ID, dtype=torch.long)
    positions = torch.zeros((batch, length), dtype=torch.long)
    slot_blocks = torch.full((batch, length), scratch_block, dtype=torch.long)
    slot_offsets = torch.arange(length).remainder(block_size).repeat(batch, 1)
    block_tables = torch.full((batch, blocks), scratch_block, dtype=torch.long)
    context_lens = torch.ones(batch, dtype=torch.long)  # empty rows see one scratch key
    query_starts = torch.zeros(batch, dtype=torch.long)
    logits_indices = torch.arange(batch) * length
    sample_rows = []
    for row, (e, n, ctx) in enumerate(zip(entries, lengths, contexts)):
        seq = e.seq
        table = torch.tensor(seq.block_table[: -(-ctx // block_size)], dtype=torch.long)
        pos = torch.arange(e.start, ctx)
        input_ids[row, :n] = torch.tensor(seq.token_ids[e.start:ctx], dtype=torch.long)
        positions[row, :n] = pos
        positions[row, n:] = ctx - 1  # pads: a valid rotary position, outputs unread
        slot_blocks[row, :n] = table[pos // block_size]
        slot_offsets[row, :n] = pos % block_size
        block_tables[row, : table.numel()] = table
        context_lens[row] = ctx
        query_starts[row] = e.start
        logits_indices[row] = row * length + n - 1
        if e.samples:
            sample_rows.append(row)
    return BucketStep(key, input_ids.flatten(), positions.flatten(), slot_blocks.flatten(), slot_offsets.flatten(),
                      block_tables, context_lens, query_starts, logits_indices, sample_rows)


BucketForward = Callable[[torch.Tensor, torch.Tensor, BucketMetadata, torch.Tensor], torch.Tensor]


class _StaticBucket:
    """One bucket's static input buffers and its runnable forward over them."""

    def __init__(self, key: BucketKey, block_size: int, device: torch.device):
        tokens = key.tokens * key.batch

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions = buffer(tokens), buffer(tokens)
        self.logits_indices = buffer(key.batch)
        self.meta = BucketMetadata(slot_blocks=buffer(tokens), slot_offsets=buffer(tokens),
                                   block_tables=buffer(key.batch, key.context_blocks),
                                   context_lens=buffer(key.batch), query_starts=buffer(key.batch),
                                   block_size=block_size)
        self.run: Callable[[], torch.Tensor] | None = None

    def load(self, step: BucketStep) -> None:
        """Copy a step's inputs into the static buffers (their addresses never change)."""
        meta = self.meta
        for static, new in ((self.input_ids, step.input_ids), (self.positions, step.positions),
                            (self.logits_indices, step.logits_indices), (meta.slot_blocks, step.slot_blocks),
                            (meta.slot_offsets, step.slot_offsets), (meta.block_tables, step.block_tables),
                            (meta.context_lens, step.context_lens), (meta.query_starts, step.query_starts)):
            static.copy_(new, non_blocking=True)

    def buffers(self) -> list[torch.Tensor]:
        meta = self.meta
        return [self.input_ids, self.positions, self.logits_indices, meta.slot_blocks, meta.slot_offsets,
                meta.block_tables, meta.context_lens, meta.query_starts]


class BucketRunner:
    """Runs steps laid out as buckets, one set of static buffers per bucket.

    `forward(input_ids, positions, meta, logits_indices) -> logits [B, vocab]` is the model's
    forward over the KV cache; `run(step)` returns None on a miss (more than `max_buckets`
    buckets), the caller then runs the step unpadded."""

    def __init__(self, forward: BucketForward, block_size: int, device: torch.device, executor: str = "eager",
                 max_buckets: int = 64):
        if executor not in EXECUTORS:
            raise ValueError(f"captured shapes executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
        if executor == "cuda_graph" and device.type != "cuda":
            raise ValueError("captured shapes executor cuda_graph needs a CUDA device; the CPU runs eager or compile")
        if max_buckets < 1:
            raise ValueError(f"max_captured_buckets must be >= 1, got {max_buckets}")
        self.forward = forward
        self.block_size = block_size
        self.device = device
        self.executor = executor
        self.max_buckets = max_buckets
        self.buckets: dict[BucketKey, _StaticBucket] = {}
        self.graph_pool = None  # one CUDA memory pool shared by every captured graph
        self.hits = 0
        self.misses = 0
        self.captures = 0

    def run(self, step: BucketStep) -> torch.Tensor | None:
        """Logits [B, vocab] of the step's rows (the caller indexes `step.sample_rows`), or None
        on a miss. The result is the bucket's output buffer for `cuda_graph`: read it before the
        next `run`."""
        bucket = self.buckets.get(step.key)
        if bucket is None:
            if len(self.buckets) >= self.max_buckets:
                self.misses += 1
                return None
            bucket = self.buckets[step.key] = _StaticBucket(step.key, self.block_size, self.device)
            bucket.load(step)
            return self._first_run(bucket)
        self.hits += 1
        bucket.load(step)
        return bucket.run()

    def _call(self, bucket: _StaticBucket) -> torch.Tensor:
        return self.forward(bucket.input_ids, bucket.positions, bucket.meta, bucket.logits_indices)

    def _first_run(self, bucket: _StaticBucket) -> torch.Tensor:
        if self.executor == "eager":
            bucket.run = lambda: self._call(bucket)
            return bucket.run()
        if self.executor == "compile":
            compiled = torch.compile(self.forward, dynamic=False, fullgraph=False)
            bucket.run = lambda: compiled(bucket.input_ids, bucket.positions, bucket.meta, bucket.logits_indices)
            return bucket.run()
        return self._capture(bucket)

    def _capture(self, bucket: _StaticBucket) -> torch.Tensor:  # pragma: no cover - needs CUDA
        # Warm-up on a side stream (as PyTorch's capture recipe asks): lazy initialisation
        # (cuBLAS handles, allocator) must not happen inside the capture. The warm-up runs
        # the real step, so its KV writes are the step's own (the replay rewrites the same).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._call(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            output = self._call(bucket)  # recorded, not run: `output` is the graph's static output
        if self.graph_pool is None:
            self.graph_pool = graph.pool()
        self.captures += 1

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        bucket.run = replay
        return replay()
