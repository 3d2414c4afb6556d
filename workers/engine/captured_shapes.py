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


def build_bucket_step(entries: Sequence, grid: ShapeGrid | None, block_size: int, scratch_block: int,
                      max_blocks: int, decode_grid: ShapeGrid | None = None) -> BucketStep | None:
    """`entries` (the step's `ScheduledEntry`s) laid out as their bucket; None when none fits.

    A step of single-token entries only (decodes) takes a bucket of `decode_grid` (one token
    length, 1, and the decode batch sizes: vLLM's decode CUDA graphs; on a GPU a decode step is
    hundreds of small kernels whose launches cost more than their work); a step of prefill
    chunks a bucket of `grid` (LAPS §3.1); a step mixing both, or one with no fitting size, none."""
    lengths = [e.num_new_tokens for e in entries]
    decodes = sum(n == 1 for n in lengths)
    chosen = decode_grid if decodes == len(lengths) else grid if not decodes else None
    shape = chosen.padded(lengths) if chosen is not None else None
    if shape is None:
        return None
    length, batch = shape
    contexts = [e.start + e.num_new_tokens for e in entries]
    blocks = context_blocks_bucket(-(-max(contexts) // block_size), -(-length // block_size), max_blocks)
    if blocks is None:
        return None
    # Laid out in Python lists, one tensor each at the end: a step of 64 decodes as 64 rows of
    # small tensor ops cost milliseconds of host time on the GPU machine.
    input_ids = [PAD_TOKEN_ID] * (batch * length)
    positions = [0] * (batch * length)
    slot_blocks = [scratch_block] * (batch * length)
    slot_offsets = [i % block_size for i in range(length)] * batch
    block_tables = [[scratch_block] * blocks for _ in range(batch)]
    context_lens = [1] * batch  # empty rows see one scratch key
    query_starts = [0] * batch
    logits_indices = [row * length for row in range(batch)]
    sample_rows = []
    for row, (e, n, ctx) in enumerate(zip(entries, lengths, contexts)):
        seq, base = e.seq, row * length
        table = seq.block_table[: -(-ctx // block_size)]
        input_ids[base:base + n] = seq.token_ids[e.start:ctx]
        positions[base:base + length] = list(range(e.start, ctx)) + [ctx - 1] * (length - n)  # pads: a valid position
        slot_blocks[base:base + n] = [table[pos // block_size] for pos in range(e.start, ctx)]
        slot_offsets[base:base + n] = [pos % block_size for pos in range(e.start, ctx)]
        block_tables[row][: len(table)] = table
        context_lens[row] = ctx
        query_starts[row] = e.start
        logits_indices[row] = base + n - 1
        if e.samples:
            sample_rows.append(row)

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    return BucketStep(BucketKey(length, batch, blocks), tensor(input_ids), tensor(positions), tensor(slot_blocks),
                      tensor(slot_offsets), tensor(block_tables), tensor(context_lens), tensor(query_starts),
                      tensor(logits_indices), sample_rows)


BucketForward = Callable[[torch.Tensor, torch.Tensor, BucketMetadata, torch.Tensor], torch.Tensor]


class _StaticBucket:
    """One bucket's static input buffers and its runnable forward over them."""

    def __init__(self, key: BucketKey, block_size: int, device: torch.device, decode_kernel: Callable | None = None):
        tokens = key.tokens * key.batch

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions = buffer(tokens), buffer(tokens)
        self.logits_indices = buffer(key.batch)
        self.meta = BucketMetadata(slot_blocks=buffer(tokens), slot_offsets=buffer(tokens),
                                   block_tables=buffer(key.batch, key.context_blocks),
                                   context_lens=buffer(key.batch), query_starts=buffer(key.batch),
                                   block_size=block_size, decode_kernel=decode_kernel)
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
                 max_buckets: int = 64, decode_kernel: Callable | None = None):
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
        self.decode_kernel = decode_kernel  # the paged decode kernel a bucket of one token per row runs
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
            bucket = self.buckets[step.key] = _StaticBucket(step.key, self.block_size, self.device, self.decode_kernel)
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
