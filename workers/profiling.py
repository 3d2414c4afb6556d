"""Worker.Profile: time real engine steps of synthetic shapes on a live worker's engine.

`splitserve profile` asks a worker for prefill times over a grid of (l_hist, l_incr) and
decode times over a grid of (batch, ctx); the CLI fits `splitserve.perf_model` to them.

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
* one `EngineLoop.call` per shape (a warm-up run, then `repeats` timed runs), so the
  worker's other requests wait at most one shape's runs between their steps; a shape
  needing more free KV blocks than there are (or beyond the model's length, or more
  sequences than the worker runs at once) is skipped and reported.

The measured time of a shape is the median of its timed runs. Pure helpers (`ProfileGrid`,
`prefill_shapes`, `decode_shapes`, `median`) take plain data; `profile_engine` is the
engine-thread function and takes its clock.
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
           "measure_prefill", "prefill_shapes", "profile_engine", "profile_on_loop"]

REQUEST_PREFIX = "__profile__"
MAX_REPEATS = 50
MAX_SHAPES = 400


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes to measure: prefill_lens x history_lens, decode_batch_sizes x decode_context_lens."""

    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512)
    history_lens: tuple[int, ...] = (0, 256, 1024)
    decode_batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    decode_context_lens: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("prefill_lens", "history_lens", "decode_batch_sizes", "decode_context_lens"):
            values = tuple(int(v) for v in getattr(self, name))
            object.__setattr__(self, name, values)
            low = 0 if name == "history_lens" else 1
            if any(v < low for v in values):
                raise ValueError(f"{name}: every value must be >= {low}, got {list(values)}")
        if not self.prefill_lens and not self.decode_batch_sizes:
            raise ValueError("nothing to measure: prefill_lens and decode_batch_sizes are both empty")
        if self.prefill_lens and not self.history_lens:
            raise ValueError("history_lens: give at least one value (0 for prefills without history)")
        if self.decode_batch_sizes and not self.decode_context_lens:
            raise ValueError("decode_context_lens: give at least one value with decode_batch_sizes")
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise ValueError(f"repeats must be in [1, {MAX_REPEATS}], got {self.repeats}")
        n = len(self.prefill_lens) * len(self.history_lens) + len(self.decode_batch_sizes) * len(
            self.decode_context_lens)
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
            repeats=request.repeats or d.repeats,
        )


DEFAULT_GRID = ProfileGrid()


@dataclass(frozen=True)
class MeasuredShape:
    """One shape's median time (seconds), or why it was skipped (seconds 0)."""

    kind: str  # "prefill" | "decode"
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


def median(values: Seq[float]) -> float:
    return float(statistics.median(values))


def _why_not(engine, tokens_per_seq: int, seqs: int) -> str:
    """Why a shape cannot run on this engine now ("" when it can)."""
    if tokens_per_seq > engine.max_model_len:
        return f"{tokens_per_seq} tokens exceed max_model_len {engine.max_model_len}"
    if seqs > engine.config.max_num_seqs:
        return f"batch {seqs} exceeds max_num_seqs {engine.config.max_num_seqs}"
    bm = engine.scheduler.block_manager
    need = seqs * bm.blocks_for_tokens(tokens_per_seq)
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


def _with_blocks(engine, seqs: list[Sequence], tokens_per_seq: int, body: Callable[[], list[float]]) -> list[float]:
    """Give each synthetic sequence reserved blocks for `tokens_per_seq` tokens, run `body`, give them back."""
    scheduler = engine.scheduler
    taken: list[int] = []
    try:
        for seq in seqs:
            blocks = scheduler.reserve_kv(tokens_per_seq)
            taken.extend(blocks)
            seq.block_table = blocks
            seq.status = SequenceStatus.RUNNING
        return body()
    finally:
        for seq in seqs:
            seq.block_table = []
        scheduler.release_reserved(taken)


def measure_prefill(engine, l_hist: int, l_incr: int, repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> MeasuredShape:
    """On the engine thread: time prefilling `l_incr` tokens on `l_hist` cached ones."""
    total = l_hist + l_incr
    why = _why_not(engine, total, 1)
    if why:
        return MeasuredShape("prefill", l_hist=l_hist, l_incr=l_incr, skipped=why)
    seq = Sequence(StageKey(f"{REQUEST_PREFIX}/p{l_hist}x{l_incr}"), _token_ids(engine, total, total), total,
                   SamplingParams(max_tokens=1, temperature=0.0), seed=0, arrival_time=0.0)
    entries = [ScheduledEntry(seq, l_hist, l_incr)]
    runs = _with_blocks(engine, [seq], total, lambda: _timed_runs(engine, entries, repeats, clock))
    return MeasuredShape("prefill", l_hist=l_hist, l_incr=l_incr, seconds=median(runs), runs=tuple(runs))


def measure_decode(engine, batch: int, ctx: int, repeats: int,
                   clock: Callable[[], float] = time.perf_counter) -> MeasuredShape:
    """On the engine thread: time one decode step of `batch` sequences each attending to `ctx` tokens."""
    why = _why_not(engine, ctx, batch) if ctx >= 2 else "ctx must be >= 2 (a prompt token and the decoded one)"
    if why:
        return MeasuredShape("decode", batch=batch, ctx=ctx, skipped=why)
    seqs = [Sequence(StageKey(f"{REQUEST_PREFIX}/d{batch}x{ctx}", i), _token_ids(engine, ctx, i), ctx - 1,
                     SamplingParams(max_tokens=2, temperature=0.0), seed=i, arrival_time=0.0)
            for i in range(batch)]
    entries = [ScheduledEntry(s, ctx - 1, 1) for s in seqs]
    runs = _with_blocks(engine, seqs, ctx, lambda: _timed_runs(engine, entries, repeats, clock))
    return MeasuredShape("decode", batch=batch, ctx=ctx, seconds=median(runs), runs=tuple(runs))


def profile_engine(engine, grid: ProfileGrid, clock: Callable[[], float] = time.perf_counter) -> ProfileResult:
    """Every shape of `grid` on `engine`, in the calling thread (tests; a worker uses `profile_on_loop`)."""
    result = ProfileResult(engine_kind=engine.spec.architecture, device=str(engine.device))
    for h, n in prefill_shapes(grid):
        _add(result, measure_prefill(engine, h, n, grid.repeats, clock))
    for b, c in decode_shapes(grid):
        _add(result, measure_decode(engine, b, c, grid.repeats, clock))
    return result


async def profile_on_loop(loop, grid: ProfileGrid, clock: Callable[[], float] = time.perf_counter) -> ProfileResult:
    """Every shape of `grid` on a worker's engine thread (`EngineLoop.call`), one call per shape."""
    engine = loop.engine
    result = ProfileResult(engine_kind=engine.spec.architecture, device=_device_name(engine))
    for h, n in prefill_shapes(grid):
        _add(result, await loop.call(lambda e, h=h, n=n: measure_prefill(e, h, n, grid.repeats, clock)))
    for b, c in decode_shapes(grid):
        _add(result, await loop.call(lambda e, b=b, c=c: measure_decode(e, b, c, grid.repeats, clock)))
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
