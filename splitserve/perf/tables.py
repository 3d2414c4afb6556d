"""Step times from measured kernel tables: the `PerfModel.tables` of a measured-data backend.

A GPU runs one engine step as separate kernels whose times add (issue 34; DynaServe §2,
LAPS §2, AMPD §2 are built on that prefill-decode interference), so a step is the sum of
four kernel classes, each looked up in a table of measured times:

    seconds = overhead + per_sequence * rows
            + kernel_scale * ( linear(T)                     GEMMs, norms, activations, all-reduces of T tokens
                             + logits(rows)                  the lm_head over the rows that get logits
                             + sum_i prefill_attention(L_i, H_i)   each chunk's attention: L_i new on H_i cached
                             + decode_attention(B, C) )      B decodes reading mean context C

`linear` has two curves, one for steps with prefill tokens (the context-phase kernels) and
one for decode-only steps (the generation-phase kernels). T counts every token of the step
(the chunks' new tokens plus one per decode); rows are the decodes plus one per chunk.

Tables are grids over their arguments, interpolated piecewise-linearly in each axis and
extended beyond the last grid point along the last segment's slope (GEMMs and attention
grow about linearly there). On construction every table is made non-decreasing along each
axis (a running maximum: the measured data dip by a few percent where the kernel library
switches tiles), so a step never gets cheaper with more work; the sizes of those dips are
what `StepTables.from_raw` reports as `monotone_fix`.

Where the tables come from (`source`) is recorded with them: `splitserve.perf.aiconfigurator`
tabulates NVIDIA aiconfigurator's database of per-op timings measured on real GPUs.
The kernel tables alone carry `overhead = 0`, `per_sequence = 0`, `kernel_scale = 1`; the
framework's own cost per step (its scheduler, input preparation, sampling, output processing:
CPU work per step and per sequence, and the gaps between kernels that isolated kernel
timings do not show) is added by `splitserve.perf.framework` from end-to-end measurements.
Pure arithmetic: no torch, no I/O (numpy only for the vectorised forms).
"""

from __future__ import annotations

import hashlib
import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["BATCH_GRID", "CHUNK_GRID", "LOGITS_GRID", "TABLES_FORMAT", "TOKEN_GRID", "StepTables", "check_step_cost",
           "context_grid", "history_grid", "monotone_grid"]

TABLES_FORMAT = 1


# The grids every tabulating backend fills (splitserve.perf.aiconfigurator from measurements,
# splitserve.perf.roofline from its fitted kernel classes). GEMM times are staircases (a step wherever the token count
# crosses a tile boundary: Qwen2.5-14B on an A100 costs 24 ms at 128 tokens, 35 ms at 160),
# so the token axes are dense: every 16 tokens to 512, 64 to 2,048, 256 to 8,192. Context
# axes follow powers of two and their midpoints up to the model's context length.
def _steps(*spans: tuple[int, int, int]) -> tuple[int, ...]:
    return tuple(sorted({x for lo, hi, step in spans for x in range(lo, hi + 1, step)}))


_POW = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
        4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072]
TOKEN_GRID = _steps((1, 16, 1), (16, 512, 16), (512, 2048, 64), (2048, 8192, 256), (8192, 32768, 1024),
                    (32768, 65536, 4096))
CHUNK_GRID = _steps((1, 16, 1), (16, 128, 16), (128, 1024, 64), (1024, 4096, 256), (4096, 32768, 2048))
BATCH_GRID = _steps((1, 64, 1), (64, 256, 8), (256, 2048, 64))
LOGITS_GRID = BATCH_GRID


def context_grid(max_len: int) -> tuple[int, ...]:
    return tuple(x for x in _POW if x < max_len) + (max_len,)


def history_grid(max_len: int) -> tuple[int, ...]:
    return (0,) + context_grid(max_len)

_AXES = ("tokens", "logits_rows", "chunk_tokens", "chunk_history", "decode_batch", "decode_context")
_CURVES = ("context_linear", "generation_linear", "logits")
_GRIDS = ("prefill_attention", "decode_attention")


def check_step_cost(obj: Any, owner: str, seconds: Sequence[str], scale: str) -> None:
    """The framework-cost fields of `obj` (the tables', `splitserve.perf.framework`'s): each of
    `seconds` a finite number >= 0, `scale` a finite number >= 1; a ValueError names the field."""
    for name in seconds:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")
    value = getattr(obj, scale)
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1.0):
        raise ValueError(f"{owner}.{scale} must be a finite number >= 1, got {value!r}")


def monotone_grid(values: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """`values` made non-decreasing along both axes (running maxima, rows then columns)."""
    rows = [list(_running_max(r)) for r in values]
    for j in range(len(rows[0]) if rows else 0):
        column = _running_max([r[j] for r in rows])
        for i, v in enumerate(column):
            rows[i][j] = v
    return tuple(tuple(r) for r in rows)


def _running_max(values: Sequence[float]) -> tuple[float, ...]:
    out, top = [], -math.inf
    for v in values:
        top = max(top, float(v))
        out.append(top)
    return tuple(out)


def _locate(grid: tuple[float, ...], x: float) -> tuple[int, float]:
    """(i, w): x lies at grid[i] + w * (grid[i+1] - grid[i]); w > 1 beyond the last point
    (linear extension); below the first point, the first point's value."""
    if x <= grid[0]:
        return 0, 0.0
    if x >= grid[-1]:
        i = len(grid) - 2
    else:
        i = bisect_right(grid, x) - 1
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def _curve(grid: tuple[float, ...], values: tuple[float, ...], x: float) -> float:
    i, w = _locate(grid, x)
    return values[i] + w * (values[i + 1] - values[i])


def _surface(gx: tuple[float, ...], gy: tuple[float, ...], table: tuple[tuple[float, ...], ...],
             x: float, y: float) -> float:
    i, wx = _locate(gx, x)
    j, wy = _locate(gy, y)
    r0, r1 = table[i], table[i + 1]
    lo = r0[j] + wy * (r0[j + 1] - r0[j])
    hi = r1[j] + wy * (r1[j + 1] - r1[j])
    return lo + wx * (hi - lo)


@dataclass(frozen=True, eq=False)
class StepTables:
    """Measured kernel-class times (seconds) on grids; see the module docstring."""

    tokens: tuple[float, ...]
    context_linear: tuple[float, ...]
    generation_linear: tuple[float, ...]
    logits_rows: tuple[float, ...]
    logits: tuple[float, ...]
    chunk_tokens: tuple[float, ...]
    chunk_history: tuple[float, ...]
    prefill_attention: tuple[tuple[float, ...], ...]  # [chunk_tokens][chunk_history]
    decode_batch: tuple[float, ...]
    decode_context: tuple[float, ...]
    decode_attention: tuple[tuple[float, ...], ...]  # [decode_batch][decode_context]
    overhead_s: float = 0.0  # seconds every non-empty step pays
    per_seq_overhead_s: float = 0.0  # seconds per sequence in the step (decodes + prefill chunks)
    kernel_scale: float = 1.0  # end-to-end kernel time / the sum of the isolated kernel timings
    source: Mapping[str, Any] = field(default_factory=dict)  # what measured them (JSON-able)
    digest: str = field(default="", init=False)
    _arrays: dict = field(default_factory=dict, init=False, repr=False)  # numpy copies, made on first use

    def __post_init__(self) -> None:
        for name in _AXES:
            grid = getattr(self, name)
            if len(grid) < 2 or any(b <= a for a, b in zip(grid, grid[1:])) or grid[0] < 0:
                raise ValueError(f"tables.{name} must be >= 2 strictly increasing values >= 0")
        for name, axis in (("context_linear", "tokens"), ("generation_linear", "tokens"), ("logits", "logits_rows")):
            if len(getattr(self, name)) != len(getattr(self, axis)):
                raise ValueError(f"tables.{name} must have one value per tables.{axis} point")
        for name, ax, ay in (("prefill_attention", "chunk_tokens", "chunk_history"),
                             ("decode_attention", "decode_batch", "decode_context")):
            table = getattr(self, name)
            if len(table) != len(getattr(self, ax)) or any(len(r) != len(getattr(self, ay)) for r in table):
                raise ValueError(f"tables.{name} must be a {ax} x {ay} grid")
        for name in (*_CURVES, *_GRIDS):
            flat = [v for r in getattr(self, name) for v in (r if isinstance(r, tuple) else (r,))]
            if any(not math.isfinite(v) or v < 0 for v in flat):
                raise ValueError(f"tables.{name} must hold finite seconds >= 0")
        check_step_cost(self, "tables", ("overhead_s", "per_seq_overhead_s"), "kernel_scale")
        text = json.dumps(self._payload(), sort_keys=True)
        object.__setattr__(self, "digest", hashlib.sha256(text.encode()).hexdigest()[:16])

    # Identity is the content: two tables with the same numbers are the same model.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepTables) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    @classmethod
    def from_raw(cls, **raw: Any) -> tuple[StepTables, dict[str, float]]:
        """Tables from measured values, each made non-decreasing along its axes; also the
        largest relative correction that took per table (`monotone_fix`)."""
        fixes: dict[str, float] = {}
        data = dict(raw)
        for name in _CURVES:
            values = tuple(float(v) for v in raw[name])
            data[name] = _running_max(values)
            fixes[name] = max(((m - v) / m if m > 0 else 0.0) for v, m in zip(values, data[name]))
        for name in _GRIDS:
            values = tuple(tuple(float(v) for v in r) for r in raw[name])
            data[name] = monotone_grid(values)
            fixes[name] = max(((m - v) / m if m > 0 else 0.0)
                              for rv, rm in zip(values, data[name]) for v, m in zip(rv, rm))
        for name in _AXES:
            data[name] = tuple(float(v) for v in raw[name])
        return cls(**data), fixes

    # ---- one step -------------------------------------------------------------------------
    def linear_s(self, tokens: float, has_prefill: bool) -> float:
        return _curve(self.tokens, self.context_linear if has_prefill else self.generation_linear, tokens)

    def logits_s(self, rows: float) -> float:
        return _curve(self.logits_rows, self.logits, rows)

    def prefill_attention_s(self, l_incr: float, l_hist: float) -> float:
        return _surface(self.chunk_tokens, self.chunk_history, self.prefill_attention, l_incr, l_hist)

    def decode_attention_s(self, batch: float, context: float) -> float:
        return _surface(self.decode_batch, self.decode_context, self.decode_attention, batch, context)

    def step_s(self, chunks: Sequence[tuple[float, float]], decode_batch: float, decode_ctx: float) -> float:
        """Seconds of one step: prefill `chunks` (l_hist, l_incr) plus `decode_batch` decodes of
        mean context `decode_ctx`; 0 for an empty step."""
        tokens, rows, attention = 0.0, 0.0, 0.0
        for hist, new in chunks:
            if new > 0:
                tokens += new
                rows += 1
                attention += self.prefill_attention_s(new, hist)
        if decode_batch > 0:
            attention += self.decode_attention_s(decode_batch, decode_ctx)
        elif tokens == 0:
            return 0.0
        kernels = self.linear_s(tokens + decode_batch, tokens > 0) + self.logits_s(rows + decode_batch) + attention
        return self.overhead_s + self.per_seq_overhead_s * (rows + decode_batch) + self.kernel_scale * kernels

    def aggregate_step_s(self, prefill_tokens: float, prefill_pairs: float, decode_batch: float,
                         decode_context_tokens: float) -> float:
        """`step_s` of a step known only by its sums (the simulator's and the timeline's form):
        T prefill tokens whose causal (query, key) pairs total `prefill_pairs`, and decodes
        reading `decode_context_tokens` in all. The chunks are taken as one chunk of T tokens
        on the history that gives the same pair count (exact for one chunk)."""
        if prefill_tokens <= 0 and decode_batch <= 0:
            return 0.0
        chunks = ()
        if prefill_tokens > 0:
            chunks = ((max(0.0, prefill_pairs / prefill_tokens - prefill_tokens / 2), prefill_tokens),)
        ctx = decode_context_tokens / decode_batch if decode_batch > 0 else 0.0
        return self.step_s(chunks, decode_batch, ctx)

    def _np(self, name: str):
        """The table `name` as a numpy array (made once: converting per call costs more than the lookup)."""
        arr = self._arrays.get(name)
        if arr is None:
            import numpy as np

            arr = self._arrays[name] = np.asarray(getattr(self, name), dtype=np.float64)
        return arr

    def step_array(self, prefill_tokens, prefill_pairs, decode_batch, decode_context_tokens):
        """`aggregate_step_s` of many steps at once (numpy arrays of equal length)."""
        import numpy as np

        tok = np.asarray(prefill_tokens, dtype=np.float64)
        pairs = np.asarray(prefill_pairs, dtype=np.float64)
        b = np.asarray(decode_batch, dtype=np.float64)
        bctx = np.asarray(decode_context_tokens, dtype=np.float64)
        has_p, has_d = tok > 0, b > 0
        safe_tok = np.where(has_p, tok, 1.0)
        hist = np.maximum(0.0, pairs / safe_tok - safe_tok / 2)
        ctx = np.where(has_d, bctx / np.where(has_d, b, 1.0), 0.0)
        a = self._np
        lin = np.where(has_p, _curve_np(a("tokens"), a("context_linear"), tok + b),
                       _curve_np(a("tokens"), a("generation_linear"), tok + b))
        kernels = (lin + _curve_np(a("logits_rows"), a("logits"), has_p + b)
                   + np.where(has_p, _surface_np(a("chunk_tokens"), a("chunk_history"), a("prefill_attention"),
                                                 safe_tok, hist), 0.0)
                   + np.where(has_d, _surface_np(a("decode_batch"), a("decode_context"), a("decode_attention"),
                                                 np.where(has_d, b, 1.0), ctx), 0.0))
        total = self.overhead_s + self.per_seq_overhead_s * (has_p + b) + self.kernel_scale * kernels
        return np.where(has_p | has_d, total, 0.0)

    def decode_run(self, batch: int, first_context_tokens: float, steps: int):
        """Seconds of `steps` consecutive decode-only steps of `batch` sequences, each a token
        longer every step (summed context `first_context_tokens` at the first)."""
        import numpy as np

        ctx = (first_context_tokens + batch * np.arange(steps, dtype=np.float64)) / batch
        # Summed in step_s's order (kernels first, then scaled), so a fast-forwarded run equals its
        # steps to the last bit.
        kernels = self.linear_s(batch, False) + self.logits_s(batch) + _curve_np(
            self._np("decode_context"), self._decode_row(batch), ctx)
        return self.overhead_s + self.per_seq_overhead_s * batch + self.kernel_scale * kernels

    def _decode_row(self, batch: int):
        """Decode attention over the context axis at one batch size (interpolated between rows)."""
        rows = self._arrays.setdefault("decode_rows", {})
        row = rows.get(batch)
        if row is None:
            i, w = _locate(self.decode_batch, float(batch))
            t = self._np("decode_attention")
            row = rows[batch] = t[i] + w * (t[i + 1] - t[i])  # batch sizes are few: max_num_seqs at most
        return row

    # ---- closed forms from the curves ---------------------------------------------------
    def linear_slope_s(self) -> float:
        """Seconds per token of the context-phase linear kernels at the largest measured
        sizes, where the GEMMs are compute-bound."""
        slope = (self.context_linear[-1] - self.context_linear[-2]) / (self.tokens[-1] - self.tokens[-2])
        return self.kernel_scale * slope

    def attention_s_per_pair(self, chunk_tokens: float = 512.0, history: float = 8192.0) -> float:
        """Seconds per (query, cached key) pair of prefill attention: what a chunk pays for
        reading history, the secant from no history to `history` at `chunk_tokens` new tokens."""
        added = self.prefill_attention_s(chunk_tokens, history) - self.prefill_attention_s(chunk_tokens, 0.0)
        return self.kernel_scale * max(0.0, added) / (chunk_tokens * history)

    def added_seconds(self, prefill: float, history: float, decode: float) -> float:
        """Seconds a request adds to the steps of the worker that runs it: `prefill` new
        tokens on `history` cached ones, then `decode` tokens (DynaServe's per-worker clock,
        Alg. 1, `services.global_scheduler.compute_clock`). Kernels add, so this is the
        request's share of every class: the GEMMs at their compute-bound seconds per token (a
        chunk or a decode beside others runs on weights the step reads anyway), each chunk's
        attention as one chunk of `prefill` tokens, and per decode token its attention's
        marginal cost in a batch of 16-64 (the secant, where the measured per-sequence cost
        has settled) at the run's mean context, plus the framework's cost per sequence."""
        slope = self.linear_slope_s()
        seconds = 0.0
        if prefill > 0:
            seconds += (slope * prefill + self.per_seq_overhead_s
                        + self.kernel_scale * self.prefill_attention_s(prefill, history))
        if decode > 0:
            mean_context = history + prefill + 1 + (decode - 1) / 2
            attention = (self.decode_attention_s(64, mean_context) - self.decode_attention_s(16, mean_context)) / 48
            seconds += decode * (slope + self.per_seq_overhead_s + self.kernel_scale * max(0.0, attention))
        return seconds

    def prefill_boundary(self, l_hist: float) -> float:
        """LAPS' L_m read off the measured curve: where a prefill's compute-bound line (the
        GEMMs' seconds per token at large sizes) reaches the cost of a one-token prefill on
        the same history (the memory-bound floor: weights and history read once)."""
        slope = self.linear_slope_s()
        if slope <= 0:
            return math.inf
        return self.step_s(((l_hist, 1.0),), 0, 0.0) / slope

    def decode_breakpoint(self, ctx: float) -> float:
        """Decode batch from which a step at mean context `ctx` is compute-bound, read the
        same way: the one-sequence step over the GEMMs' seconds per token."""
        slope = self.linear_slope_s()
        return self.step_s((), 1, ctx) / slope if slope > 0 else math.inf

    # ---- serialisation --------------------------------------------------------------------
    def _payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: list(getattr(self, name)) for name in (*_AXES, *_CURVES)}
        for name in _GRIDS:
            out[name] = [list(r) for r in getattr(self, name)]
        out["overhead_s"] = self.overhead_s
        if self.per_seq_overhead_s or self.kernel_scale != 1.0:  # kernel tables keep their digest
            out["per_seq_overhead_s"] = self.per_seq_overhead_s
            out["kernel_scale"] = self.kernel_scale
        out["source"] = dict(self.source)
        out["format"] = TABLES_FORMAT
        return out

    def to_dict(self) -> dict[str, Any]:
        return self._payload()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTables:
        if not isinstance(data, Mapping):
            raise ValueError("tables must be an object")
        if data.get("format") != TABLES_FORMAT:
            raise ValueError(f"tables.format must be {TABLES_FORMAT}, got {data.get('format')!r}")
        missing = [n for n in (*_AXES, *_CURVES, *_GRIDS) if n not in data]
        if missing:
            raise ValueError(f"tables is missing {missing}")
        try:
            kw: dict[str, Any] = {n: tuple(float(v) for v in data[n]) for n in (*_AXES, *_CURVES)}
            for n in _GRIDS:
                kw[n] = tuple(tuple(float(v) for v in r) for r in data[n])
            overhead = float(data.get("overhead_s", 0.0))
            per_seq = float(data.get("per_seq_overhead_s", 0.0))
            scale = float(data.get("kernel_scale", 1.0))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tables: {exc}") from None
        source = data.get("source", {})
        if not isinstance(source, Mapping):
            raise ValueError("tables.source must be an object")
        return cls(**kw, overhead_s=overhead, per_seq_overhead_s=per_seq, kernel_scale=scale, source=dict(source))


def _curve_np(g, v, x):
    import numpy as np

    i = np.clip(np.searchsorted(g, x, side="right") - 1, 0, len(g) - 2)
    w = np.maximum((x - g[i]) / (g[i + 1] - g[i]), 0.0)
    return v[i] + w * (v[i + 1] - v[i])


def _surface_np(ax, ay, t, x, y):
    import numpy as np

    i = np.clip(np.searchsorted(ax, x, side="right") - 1, 0, len(ax) - 2)
    j = np.clip(np.searchsorted(ay, y, side="right") - 1, 0, len(ay) - 2)
    wx = np.maximum((x - ax[i]) / (ax[i + 1] - ax[i]), 0.0)
    wy = np.maximum((y - ay[j]) / (ay[j + 1] - ay[j]), 0.0)
    lo = t[i, j] + wy * (t[i, j + 1] - t[i, j])
    hi = t[i + 1, j] + wy * (t[i + 1, j + 1] - t[i + 1, j])
    return lo + wx * (hi - lo)
