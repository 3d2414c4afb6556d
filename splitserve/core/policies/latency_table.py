"""DynaServe's profile table (§4.2, Alg. 2): (prefill tokens, decode context, decode count) -> step latency.

The table holds latencies at the vertices of a fixed grid:

* prefill tokens `p`: 0, 16, 32, ..., 65,536 (14 points; powers of two from one block);
* decode count `d`: 0, 1, 2, 4, ..., 4,096 (14 points);
* mean decode context `c`: 0, 64, 128, ..., 1,048,576 tokens (16 points);

3,136 floats in all, whatever runs: its memory is bounded by construction. Between
vertices a latency is the multilinear interpolation of the cell's corners (beyond the
last vertex of an axis, the last segment extended). The grid is kept non-decreasing along
every axis, so the interpolation is non-decreasing in every argument too, and
`max_prefill` (MaxPrefillAllowed) is a binary search over the prefill axis followed by the
inverse of one linear segment: a handful of lookups, microseconds a call.

Where the values come from:

* a prior: `PerfModel.step_time` of one prefill chunk of `p` tokens on no history beside
  `d` decodes of mean context `c`, at every vertex (the emulated worker's preset, the
  simulator's model, or `splitserve profile`'s fit); none: zeros, an optimistic start that
  every observation raises (below);
* every executed step (`observe`): normalised least-mean-squares on the corners of the
  step's cell, so that the prediction at the observed point moves a fraction
  `learning_rate` of the way to the measurement (an EWMA at that point; across a cell, an
  online least-squares fit). Then the grid is made non-decreasing again by moving the
  neighbours the update crossed (raised successors after a rise, lowered predecessors
  after a fall): a table that starts from a wrong model converges to the measured
  latencies where steps run, which is where the policy asks.

A prefill chunk on history (a later chunk of a long prompt, KV of an earlier stage) also
reads that history's KV: `l_incr * l_hist` attention pairs. That cost is not a table
axis; it is `history_cost_s_per_pair` (the prior's `attention_s_per_pair`, 0 without a prior) times the
pairs, added to the table's prediction and subtracted from an observation before it
updates the table. It is not learned: learned with the corners (one more parameter of
the same update) it traded off against cells not yet corrected and swung far from the
truth (measured: from a model 2x too fast, to 7x the true coefficient, and steps 45% past
the target). With a wrong prior, or none, the table absorbs the error on average: steps
reading more history than the cell's average run a few percent long (measured: about
5% past the target with a prior 2x off, inside the policy's default 10% margin).
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.core.step_cost import StepShape
    from splitserve.perf.model import PerfModel

__all__ = ["CONTEXT_GRID", "DECODE_GRID", "LatencyTable", "PREFILL_GRID"]

PREFILL_GRID: tuple[int, ...] = (0,) + tuple(16 << k for k in range(13))  # 0, 16 .. 65,536
DECODE_GRID: tuple[int, ...] = (0,) + tuple(1 << k for k in range(13))  # 0, 1 .. 4,096
CONTEXT_GRID: tuple[int, ...] = (0,) + tuple(64 << k for k in range(15))  # 0, 64 .. 1,048,576

_NP, _ND, _NC = len(PREFILL_GRID), len(DECODE_GRID), len(CONTEXT_GRID)
_STRIDE_D = _NP  # vertex index: (ci * _ND + di) * _NP + pi
_STRIDE_C = _ND * _NP
_SIZE = _NC * _STRIDE_C
_REL_TOLERANCE = 1e-9  # an observation this close to the prediction teaches nothing


def _locate(grid: tuple[int, ...], x: float) -> tuple[int, float]:
    """Segment i and weight w of x: x = (1 - w) * grid[i] + w * grid[i + 1]; w > 1 beyond the end."""
    i = bisect_right(grid, x) - 1
    if i >= len(grid) - 1:
        i = len(grid) - 2
    elif i < 0:
        return 0, 0.0
    lo = grid[i]
    return i, (x - lo) / (grid[i + 1] - lo)


def _locate_clamped(grid: tuple[int, ...], x: float) -> tuple[int, float]:
    i, w = _locate(grid, x)
    return (i, 1.0) if w > 1.0 else (i, w)


@lru_cache(maxsize=16)
def _prior_values(prior: PerfModel) -> tuple[float, ...]:
    """The grid's vertices under `prior` (cached: a simulator builds one table per worker)."""
    values = []
    for c in CONTEXT_GRID:
        for d in DECODE_GRID:
            for p in PREFILL_GRID:
                values.append(prior.step_time(((0, p),) if p else (), d, float(c)))
    return tuple(values)


class LatencyTable:
    """Step latency by (prefill tokens, mean decode context, decode count); see the module docstring."""

    __slots__ = ("_v", "learning_rate", "history_cost_s_per_pair", "num_observations", "prior_label")

    def __init__(self, prior: PerfModel | None = None, learning_rate: float = 0.2):
        if not 0.0 < learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate!r}")
        self.learning_rate = float(learning_rate)
        self._v: list[float] = list(_prior_values(prior)) if prior is not None else [0.0] * _SIZE
        self.history_cost_s_per_pair = prior.attention_s_per_pair if prior is not None else 0.0
        self.num_observations = 0
        self.prior_label = prior.label if prior is not None else ""

    def __len__(self) -> int:
        """Number of vertices (fixed)."""
        return len(self._v)

    # ---- queries ---------------------------------------------------------------------
    def predict(self, prefill_tokens: float, decode_ctx: float, num_decodes: float,
                history_pairs: float = 0.0) -> float:
        """Predicted seconds of a step: `prefill_tokens` new prefill tokens (with
        `history_pairs` = sum of l_incr * l_hist over its chunks) beside `num_decodes` decodes
        of mean context `decode_ctx`."""
        pi, wp = _locate(PREFILL_GRID, prefill_tokens)
        di, wd = _locate(DECODE_GRID, num_decodes)
        ci, wc = _locate(CONTEXT_GRID, decode_ctx)
        v = self._v
        total = 0.0
        for dc, fc in ((0, 1.0 - wc), (_STRIDE_C, wc)):
            for dd, fd in ((0, 1.0 - wd), (_STRIDE_D, wd)):
                f = fc * fd
                if f:
                    base = ci * _STRIDE_C + di * _STRIDE_D + pi + dc + dd
                    total += f * ((1.0 - wp) * v[base] + wp * v[base + 1])
        return total + self.history_cost_s_per_pair * history_pairs

    def predict_shape(self, shape: StepShape) -> float:
        """Predicted seconds of a step of this shape."""
        return self.predict(shape.num_prefill_tokens, shape.mean_decode_context, shape.num_decodes,
                            _history_pairs(shape))

    def max_prefill(self, target_s: float, decode_ctx: float, num_decodes: int, limit: int = 1 << 20) -> int:
        """MaxPrefillAllowed: the most prefill tokens (on no history) a step beside `num_decodes`
        decodes of mean context `decode_ctx` may take and stay predicted within `target_s`;
        0 when even the decodes alone do not fit; at most `limit`. Non-decreasing in
        `target_s`, non-increasing in `decode_ctx` and `num_decodes`."""
        di, wd = _locate(DECODE_GRID, num_decodes)
        ci, wc = _locate(CONTEXT_GRID, decode_ctx)
        v = self._v
        b00 = ci * _STRIDE_C + di * _STRIDE_D
        b01, b10 = b00 + _STRIDE_D, b00 + _STRIDE_C
        b11 = b10 + _STRIDE_D
        w00, w01, w10, w11 = (1.0 - wc) * (1.0 - wd), (1.0 - wc) * wd, wc * (1.0 - wd), wc * wd

        def at(k: int) -> float:  # the latency at prefill vertex k for this (c, d)
            return w00 * v[b00 + k] + w01 * v[b01 + k] + w10 * v[b10 + k] + w11 * v[b11 + k]

        lo_v = at(0)
        if lo_v > target_s:
            return 0
        last = _NP - 1
        hi_v = at(last)
        if hi_v <= target_s:  # beyond the grid: the last segments extended
            # With the steepest last segment of the whole table, not this (c, d)'s own: a
            # longer context may have a flatter last segment, and its own slope would then
            # allow *more* prefill than a shorter context (found by the property test). The
            # steepest slope keeps the answer non-increasing in context and decodes, and
            # within target wherever `predict` extrapolates with a local slope.
            slope = self._steepest_last_slope()
            if slope <= 0:
                return limit
            return min(limit, int(PREFILL_GRID[last] + (target_s - hi_v) / slope))
        lo, hi = 0, last  # at(lo) <= target < at(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            mid_v = at(mid)
            if mid_v <= target_s:
                lo, lo_v = mid, mid_v
            else:
                hi = mid
        hi_v = at(hi)
        p_lo = PREFILL_GRID[lo]
        tokens = p_lo + (target_s - lo_v) / (hi_v - lo_v) * (PREFILL_GRID[hi] - p_lo)
        return min(limit, int(tokens))

    def _steepest_last_slope(self) -> float:
        """The largest slope of the last prefill segment over every (context, decodes) vertex."""
        v, last = self._v, _NP - 1
        width = PREFILL_GRID[last] - PREFILL_GRID[last - 1]
        return max(v[base + last] - v[base + last - 1] for base in range(0, len(v), _NP)) / width

    # ---- learning ------------------------------------------------------------------------
    def observe_shape(self, shape: StepShape, latency_s: float) -> None:
        """Refine the table with one executed step's shape and measured latency."""
        self.observe(shape.num_prefill_tokens, shape.mean_decode_context, shape.num_decodes, latency_s,
                     _history_pairs(shape))

    def observe(self, prefill_tokens: float, decode_ctx: float, num_decodes: float, latency_s: float,
                history_pairs: float = 0.0) -> None:
        """Move the prediction at this point `learning_rate` of the way to `latency_s`."""
        if not latency_s > 0.0 or latency_s == float("inf") or (prefill_tokens <= 0 and num_decodes <= 0):
            return  # an empty step, or no measurement
        self.num_observations += 1
        y = latency_s - self.history_cost_s_per_pair * history_pairs
        if y <= 0.0:
            return
        pi, wp = _locate_clamped(PREFILL_GRID, prefill_tokens)
        di, wd = _locate_clamped(DECODE_GRID, num_decodes)
        ci, wc = _locate_clamped(CONTEXT_GRID, decode_ctx)
        v = self._v
        corners: list[tuple[int, float]] = []
        predicted = norm = 0.0
        for dc, fc in ((0, 1.0 - wc), (_STRIDE_C, wc)):
            if not fc:
                continue
            for dd, fd in ((0, 1.0 - wd), (_STRIDE_D, wd)):
                if not fd:
                    continue
                for dp, fp in ((0, 1.0 - wp), (1, wp)):
                    w = fc * fd * fp
                    if w:
                        i = ci * _STRIDE_C + di * _STRIDE_D + pi + dc + dd + dp
                        corners.append((i, w))
                        predicted += w * v[i]
                        norm += w * w
        error = y - predicted
        if abs(error) <= _REL_TOLERANCE * y:
            return
        gain = self.learning_rate * error / norm
        for i, w in corners:
            v[i] = max(0.0, v[i] + gain * w)
        self._restore_monotonicity([i for i, _ in corners], raised=error > 0)

    def _restore_monotonicity(self, changed: list[int], raised: bool) -> None:
        """Make the grid non-decreasing along every axis again after `changed` moved (all the
        same way): raise the successors below a raised vertex, lower the predecessors above
        a lowered one, transitively (each vertex is moved at most to the value that crossed
        it, so the prediction at the update's point only moves further the same way)."""
        v = self._v
        stack = list(changed)
        while stack:
            i = stack.pop()
            x = v[i]
            pi = i % _NP
            di = (i // _STRIDE_D) % _ND
            ci = i // _STRIDE_C
            if raised:
                for ok, j in ((pi < _NP - 1, i + 1), (di < _ND - 1, i + _STRIDE_D), (ci < _NC - 1, i + _STRIDE_C)):
                    if ok and v[j] < x:
                        v[j] = x
                        stack.append(j)
            else:
                for ok, j in ((pi > 0, i - 1), (di > 0, i - _STRIDE_D), (ci > 0, i - _STRIDE_C)):
                    if ok and v[j] > x:
                        v[j] = x
                        stack.append(j)

    def is_monotone(self) -> bool:
        """Whether the grid is non-decreasing along every axis (an invariant; for tests)."""
        v = self._v
        for i, x in enumerate(v):
            pi = i % _NP
            di = (i // _STRIDE_D) % _ND
            ci = i // _STRIDE_C
            if (pi and v[i - 1] > x) or (di and v[i - _STRIDE_D] > x) or (ci and v[i - _STRIDE_C] > x):
                return False
        return True


def _history_pairs(shape: StepShape) -> int:
    pairs = 0
    for h, n in shape.prefill_chunks:
        pairs += h * n
    return pairs
