"""Worker.Profile: time real engine steps of synthetic shapes on a live worker's engine.

`splitserve profile` asks a worker for prefill times over a grid of (l_hist, l_incr), decode
times over a grid of (batch, ctx) and mixed-step times over a grid of (l_hist, l_incr, batch,
ctx); the CLI fits `splitserve.perf.model` to them.

Every measurement is one real forward pass of the worker's own runner (`runner.execute`:
the CPU/CUDA model, or the emulated runner's paced sleep), run on the engine thread
through `EngineLoop.call`, between two steps of whatever else the worker is serving:

* the synthetic sequences own KV blocks taken with `BlockManager.reserve` (plain blocks
  belonging to no sequence; prefix-cached blocks are only evicted as any allocation
  would) and given back with `release_reserved` when the shape is done, also on error;
  nothing is indexed in the prefix cache, nothing enters the scheduler's queues, the batch
  policy observes nothing, so other requests' KV, queues and outputs are untouched;
* a prefill of `l_incr` tokens on `l_hist` holds blocks for l_hist + l_incr tokens and
  runs positions [l_hist, l_hist + l_incr): attention reads the l_hist positions' blocks
  (whatever they hold: only the time matters) exactly as a chunk on cached history would;
* a decode step of `batch` sequences at context `ctx` runs one token per sequence at
  position ctx - 1 (so each attends to `ctx` tokens: the perf model's decode context,
  `ScheduledEntry.start + 1`, as the emulated runner and the simulator count it);
* a mixed step (l_hist, l_incr, batch, ctx) is both in ONE forward pass: the prefill chunk
  above beside the decode batch above (the chunked-prefill step a scheduler builds when a
  prompt arrives while others decode); it holds the blocks of both;
* one `EngineLoop.call` per shape (a warm-up run, then `repeats` timed runs), so the
  worker's other requests wait at most one shape's runs between their steps; a shape
  needing more free KV blocks than there are (or beyond the model's length, or more
  sequences than the worker runs at once) is skipped and reported.

The measured time of a shape is the median of its timed runs. Pure helpers (`ProfileGrid`,
`prefill_shapes`, `decode_shapes`, `mixed_shapes`, `median`) take plain data;
`profile_engine` is the engine-thread function and takes its clock.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

from splitserve.core import SamplingParams, ScheduledEntry, SchedulerOutput, Sequence, SequenceStatus, StageKey

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_GRID", "MeasuredShape", "ProfileGrid", "ProfileResult", "decode_shapes", "measure_decode",
           "measure_mixed", "measure_prefill", "mixed_shapes", "prefill_shapes", "profile_engine", "profile_on_loop"]

REQUEST_PREFIX = "__profile__"
MAX_REPEATS = 50
MAX_SHAPES = 400


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes to measure: prefill_lens x history_lens, decode_batch_sizes x decode_context_lens,
    and mixed steps mixed_prefill_lens x mixed_history_lens x mixed_decode_batch_sizes x
    mixed_decode_context_lens (a chunk of L tokens on H cached ones beside B decodes at
    context C, in one step; an empty mixed_prefill_lens measures none)."""

    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512)
    history_lens: tuple[int, ...] = (0, 256, 1024)
    decode_batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    decode_context_lens: tuple[int, ...] = (64, 256, 1024)
    mixed_prefill_lens: tuple[int, ...] = (32, 128, 384)
    mixed_history_lens: tuple[int, ...] = (0, 256)
    mixed_decode_batch_sizes: tuple[int, ...] = (1, 8, 24)
    mixed_decode_context_lens: tuple[int, ...] = (64, 512)
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("prefill_lens", "history_lens", "decode_batch_sizes", "decode_context_lens",
                     "mixed_prefill_lens", "mixed_history_lens", "mixed_decode_batch_sizes",
                     "mixed_decode_context_lens"):
            values = tuple(int(v) for v in getattr(self, name))
            object.__setattr__(self, name, values)
            low = 0 if name in ("history_lens", "mixed_history_lens") else 1
            if any(v < low for v in values):
                raise ValueError(f"{name}: every value must be >= {low}, got {list(values)}")
        if not self.prefill_lens and not self.decode_batch_sizes and not self.mixed_prefill_lens:
            raise ValueError("nothing to measure: prefill_lens, decode_batch_sizes and mixed_prefill_lens are all empty")
        if self.prefill_lens and not self.history_lens:
            raise ValueError("history_lens: give at least one value (0 for prefills without history)")
        if self.decode_batch_sizes and not self.decode_context_lens:
            raise ValueError("decode_context_lens: give at least one value with decode_batch_sizes")
        if self.mixed_prefill_lens:
            for name in ("mixed_history_lens", "mixed_decode_batch_sizes", "mixed_decode_context_lens"):
                if not getattr(self, name):
                    raise ValueError(f"{name}: give at least one value with mixed_prefill_lens")
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise ValueError(f"repeats must be in [1, {MAX_REPEATS}], got {self.repeats}")
        n = (len(self.prefill_lens) * len(self.history_lens)
             + len(self.decode_batch_sizes) * len(self.decode_context_lens)
             + len(self.mixed_prefill_lens) * len(self.mixed_history_lens) * len(self.mixed_decode_batch_sizes)
             * len(self.mixed_decode_context_lens))
        if n > MAX_SHAPES:
            raise ValueError(f"{n} shapes: at most {MAX_SHAPES} per profile")

    @classmethod
    def from_request(cls, request: Any) -> ProfileGrid:
        """From a `worker_pb2.ProfileRequest`; empty fields take the defaults (repeats 0 -> 3)."""
        d = cls()
        return cls(
            prefill_lens=tuple(request.prefill_lens) or d.prefill_lens,
            history_lens=tuple(request.history_lens) or d.history_lens,
            decode_batch_sizes=tuple(request.decode_batch_sizes) or d.decode_batch_sizes,
            decode_context_lens=tuple(request.decode_context_lens) or d.decode_context_lens,
            mixed_prefill_lens=tuple(request.mixed_prefill_lens) or d.mixed_prefill_lens,
            mixed_history_lens=tuple(request.mixed_history_lens) or d.mixed_history_lens,
            mixed_decode_batch_sizes=tuple(request.mixed_decode_batch_sizes) or d.mixed_decode_batch_sizes,
            mixed_decode_context_lens=tuple(request.mixed_decode_context_lens) or d.mixed_decode_context_lens,
            repeats=request.repeats or d.repeats,
        )


DEFAULT_GRID = ProfileGrid()


@dataclass(frozen=True)
class MeasuredShape:
    """One shape's median time (seconds), or why it was skipped (seconds 0)."""

    kind: str  # "prefill" | "decode" | "mixed" (l_hist, l_incr: the chunk; batch, ctx: the decodes)
    l_hist: int = 0
    l_incr: int = 0
    batch: int = 0
    ctx: int = 0
    seconds: float = 0.0
    runs: tuple[float, ...] = ()
    skipped: str = ""


@dataclass
class ProfileResult:
    samples: list[MeasuredShape] = field(default_factory=list)
    skipped: list[MeasuredShape] = field(default_factory=list)
    engine_kind: str = ""
    device: str = ""


def prefill_shapes(grid: ProfileGrid) -> list[tuple[int, int]]:
    """(l_hist, l_incr) pairs, history-major."""
    return [(h, n) for h in grid.history_lens for n in grid.prefill_lens]


def decode_shapes(grid: ProfileGrid) -> list[tuple[int, int]]:
    """(batch, ctx) pairs, batch-major."""
    return [(b, c) for b in grid.decode_batch_sizes for c in grid.decode_context_lens]


def mixed_shapes(grid: ProfileGrid) -> list[tuple[int, int, int, int]]:
    """(l_hist, l_incr, batch, ctx) of the mixed steps, history-major then chunk, batch, context."""
    return [(h, n, b, c) for h in grid.mixed_history_lens for n in grid.mixed_prefill_lens
            for b in grid.mixed_decode_batch_sizes for c in grid.mixed_decode_context_lens]


def median(values: Seq[float]) -> float:
    return float(statistics.median(values))


def _why_not(engine, tokens_per_seq: int, seqs: int, also: Seq[int] = ()) -> str:
    """Why a shape cannot run on this engine now ("" when it can): `seqs` sequences of
    `tokens_per_seq` tokens, plus one sequence of each length in `also`."""
    for tokens in (tokens_per_seq, *also):
        if tokens > engine.max_model_len:
            return f"{tokens} tokens exceed max_model_len {engine.max_model_len}"
    if seqs + len(also) > engine.config.max_num_seqs:
        return f"batch {seqs + len(also)} exceeds max_num_seqs {engine.config.max_num_seqs}"
    bm = engine.scheduler.block_manager
    need = seqs * bm.blocks_for_tokens(tokens_per_seq) + sum(bm.blocks_for_tokens(t) for t in also)
    if need > bm.num_free_blocks:
        return f"needs {need} free KV blocks, {bm.num_free_blocks} free"
    return ""


def _token_ids(engine, n: int, salt: int) -> list[int]:
    """n deterministic token ids inside the vocabulary, avoiding EOS and other special ids."""
    vocab = engine.spec.vocab_size
    avoid = set(engine.spec.eos_token_ids) | set(getattr(engine.spec, "special_token_ids", []) or [])
    out = []
    x = salt * 7919 + 17
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        t = x % vocab
        while t in avoid:
            t = (t + 1) % vocab
        out.append(t)
    return out


def _timed_runs(engine, entries: list[ScheduledEntry], repeats: int, clock: Callable[[], float]) -> list[float]:
    runner = engine.runner
    step = SchedulerOutput.of(entries)  # a step no scheduler chose: the runner executes it all the same
    runner.execute(step)  # warm-up: allocator, kernels, caches
    runs = []
    for _ in range(repeats):
        started = clock()
        runner.execute(step)
        runs.append(clock() - started)
    return runs


def _with_blocks(engine, seqs: list[Sequence], tokens_per_seq: int | Seq[int],
                 body: Callable[[], list[float]]) -> list[float]:
    """Give each synthetic sequence reserved blocks for `tokens_per_seq` tokens (one count for
    all, or one per sequence), run `body`, give them back."""
    scheduler = engine.scheduler
    counts = [tokens_per_seq] * len(seqs) if isinstance(tokens_per_seq, int) else list(tokens_per_seq)
    taken: list[int] = []
    try:
        for seq, tokens in zip(seqs, counts):
            blocks = scheduler.reserve_kv(tokens)
            taken.extend(blocks)
            seq.block_table = blocks
            seq.status = SequenceStatus.RUNNING
        return body()
    finally:
        for seq in seqs:
            seq.block_table = []
        scheduler.release_reserved(taken)


def _prefill_seq(engine, l_hist: int, l_incr: int, name: str) -> tuple[Sequence, ScheduledEntry]:
    """A synthetic prompt of l_hist + l_incr tokens and its last chunk [l_hist, l_hist + l_incr)."""
    total = l_hist + l_incr
    seq = Sequence(StageKey(f"{REQUEST_PREFIX}/{name}"), _token_ids(engine, total, total), total,
                   SamplingParams(max_tokens=1, temperature=0.0), seed=0, arrival_time=0.0)
    return seq, ScheduledEntry(seq, l_hist, l_incr)


def _decode_seqs(engine, batch: int, ctx: int, name: str) -> tuple[list[Sequence], list[ScheduledEntry]]:
    """`batch` synthetic sequences decoding one token each at position ctx - 1."""
    seqs = [Sequence(StageKey(f"{REQUEST_PREFIX}/{name}", i), _token_ids(engine, ctx, i), ctx - 1,
                     SamplingParams(max_tokens=2, temperature=0.0), seed=i, arrival_time=0.0)
            for i in range(batch)]
    return seqs, [ScheduledEntry(s, ctx - 1, 1) for s in seqs]


def measure_prefill(engine, l_hist: int, l_incr: int, repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> MeasuredShape:
    """On the engine thread: time prefilling `l_incr` tokens on `l_hist` cached ones."""
    total = l_hist + l_incr
    why = _why_not(engine, total, 1)
    if why:
        return MeasuredShape("prefill", l_hist=l_hist, l_incr=l_incr, skipped=why)
    seq, entry = _prefill_seq(engine, l_hist, l_incr, f"p{l_hist}x{l_incr}")
    runs = _with_blocks(engine, [seq], total, lambda: _timed_runs(engine, [entry], repeats, clock))
    return MeasuredShape("prefill", l_hist=l_hist, l_incr=l_incr, seconds=median(runs), runs=tuple(runs))


def measure_decode(engine, batch: int, ctx: int, repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> MeasuredShape:
    """On the engine thread: time one decode step of `batch` sequences each attending to `ctx` tokens."""
    why = _why_not(engine, ctx, batch) if ctx >= 2 else "ctx must be >= 2 (a prompt token and the decoded one)"
    if why:
        return MeasuredShape("decode", batch=batch, ctx=ctx, skipped=why)
    seqs, entries = _decode_seqs(engine, batch, ctx, f"d{batch}x{ctx}")
    runs = _with_blocks(engine, seqs, ctx, lambda: _timed_runs(engine, entries, repeats, clock))
    return MeasuredShape("decode", batch=batch, ctx=ctx, seconds=median(runs), runs=tuple(runs))


def measure_mixed(engine, l_hist: int, l_incr: int, batch: int, ctx: int, repeats: int,
                  clock: Callable[[], float] = time.perf_counter) -> MeasuredShape:
    """On the engine thread: time one step holding a prefill chunk of `l_incr` tokens on
    `l_hist` cached ones and a decode batch of `batch` sequences each attending to `ctx` tokens."""
    total = l_hist + l_incr
    why = (_why_not(engine, ctx, batch, also=(total,)) if ctx >= 2
           else "ctx must be >= 2 (a prompt token and the decoded one)")
    if why:
        return MeasuredShape("mixed", l_hist=l_hist, l_incr=l_incr, batch=batch, ctx=ctx, skipped=why)
    name = f"m{l_hist}x{l_incr}+{batch}x{ctx}"
    seq, entry = _prefill_seq(engine, l_hist, l_incr, name + "/p")
    seqs, entries = _decode_seqs(engine, batch, ctx, name + "/d")
    runs = _with_blocks(engine, [seq, *seqs], [total] + [ctx] * batch,
                        lambda: _timed_runs(engine, [entry, *entries], repeats, clock))
    return MeasuredShape("mixed", l_hist=l_hist, l_incr=l_incr, batch=batch, ctx=ctx, seconds=median(runs),
                         runs=tuple(runs))


def profile_engine(engine, grid: ProfileGrid, clock: Callable[[], float] = time.perf_counter) -> ProfileResult:
    """Every shape of `grid` on `engine`, in the calling thread (tests; a worker uses `profile_on_loop`)."""
    result = ProfileResult(engine_kind=engine.spec.architecture, device=str(engine.device))
    for h, n in prefill_shapes(grid):
        _add(result, measure_prefill(engine, h, n, grid.repeats, clock))
    for b, c in decode_shapes(grid):
        _add(result, measure_decode(engine, b, c, grid.repeats, clock))
    for h, n, b, c in mixed_shapes(grid):
        _add(result, measure_mixed(engine, h, n, b, c, grid.repeats, clock))
    return result


async def profile_on_loop(loop, grid: ProfileGrid, clock: Callable[[], float] = time.perf_counter) -> ProfileResult:
    """Every shape of `grid` on a worker's engine thread (`EngineLoop.call`), one call per shape."""
    engine = loop.engine
    result = ProfileResult(engine_kind=engine.spec.architecture, device=_device_name(engine))
    for h, n in prefill_shapes(grid):
        _add(result, await loop.call(lambda e, h=h, n=n: measure_prefill(e, h, n, grid.repeats, clock)))
    for b, c in decode_shapes(grid):
        _add(result, await loop.call(lambda e, b=b, c=c: measure_decode(e, b, c, grid.repeats, clock)))
    for h, n, b, c in mixed_shapes(grid):
        _add(result, await loop.call(
            lambda e, h=h, n=n, b=b, c=c: measure_mixed(e, h, n, b, c, grid.repeats, clock)))
    log.info("profiled %d shapes (%d skipped) on %s", len(result.samples), len(result.skipped), result.device)
    return result


def _add(result: ProfileResult, shape: MeasuredShape) -> None:
    (result.skipped if shape.skipped else result.samples).append(shape)


def _device_name(engine) -> str:
    device = str(engine.device)
    if device.startswith("cuda"):
        try:
            import torch

            return f"{device} {torch.cuda.get_device_name(engine.device)}"
        except Exception:  # the name is informative only
            return device
    return device


def to_response(result: ProfileResult):
    """The `worker_pb2.ProfileResponse` of a result (skipped shapes are left out)."""
    from splitserve.proto import worker_pb2

    return worker_pb2.ProfileResponse(
        samples=[worker_pb2.ProfileSample(kind=s.kind, l_hist=s.l_hist, l_incr=s.l_incr, batch=s.batch, ctx=s.ctx,
                                          seconds=s.seconds) for s in result.samples],
        engine_kind=result.engine_kind, device=result.device)


async def handle_profile(server, request):
    """Worker.Profile: validate the grid, measure on the engine thread, answer the samples."""
    grid = ProfileGrid.from_request(request)
    return to_response(await profile_on_loop(server.loop, grid))
