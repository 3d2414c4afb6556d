"""LAPS' length classes: a (re-)prefill is short or long by the boundary L_m(H).

Paper: LAPS §2.1 (`../shared/papers/laps.txt` in the development tree). A prefill of L new
tokens on H tokens already cached is memory-bound while L is below L_m(H), the new-token
count at which its compute time overtakes its memory time (the roofline's ridge: where
arithmetic intensity reaches peak FLOPs / bandwidth); from there on it is compute-bound.
Short prefills batch almost for free; long ones saturate the device alone. The local
`laps` batch policy (temporal mode) and the `laps` placement policy (spatial mode: short
and long pools) classify with the same `LengthBoundary`, so a request is short or long
alike on every layer.

L_m comes from the performance model's compute and memory terms
(`PerfModel.prefill_boundary`), or is fixed (`boundary_tokens`). A re-prefill is
classified with its history: H raises the memory term (the cached KV is read) and the
attention compute alike, so L_m(H) moves with H.

**Online refit** (`observe`): every measured step that ran one prefill and nothing else
corrects the term that bounds it by the model: an EWMA of measured / predicted time
scales the compute terms (when the model calls the step compute-bound) or the memory
terms (memory-bound). L_m(H) is then the ridge of the scaled roofline. With measured
tables (whose steps are sums of kernel classes, not a max) the regime is the side of the
scaled L_m the step's size is on, the ratio is to the whole predicted step, and
L_m(H) = tables' L_m(H) × memory scale / compute scale (their L_m is a one-token
prefill's cost over the GEMMs' seconds per token). Two scale factors
keep the model's shape (fitted offline by `splitserve profile`, or a preset) and follow
the device it really runs on: a GPU whose memory is slower than its preset says moves
its L_m up, one whose compute is slower moves it down.
"""

from __future__ import annotations

import math
from dataclasses import replace

from splitserve.perf.model import PerfModel

__all__ = ["DEFAULT_BOUNDARY_TOKENS", "LengthBoundary"]

# Without a performance model: LAPS §2.1 measures the boundary at 150-512 tokens on current GPUs.
DEFAULT_BOUNDARY_TOKENS = 256


class LengthBoundary:
    """L_m(H) from a performance model (or a fixed count), and the class of a (re-)prefill."""

    __slots__ = ("perf_model", "fixed_tokens", "learning_rate", "compute_scale", "memory_scale",
                 "num_observed", "_scaled", "_scaled_at")

    def __init__(self, perf_model: PerfModel | None = None, fixed_tokens: int | None = None,
                 learning_rate: float = 0.05):
        if fixed_tokens is not None and fixed_tokens < 1:
            raise ValueError(f"boundary_tokens must be >= 1, got {fixed_tokens}")
        if not 0 < learning_rate <= 1:
            raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate}")
        self.perf_model = perf_model
        self.fixed_tokens = fixed_tokens if fixed_tokens is not None or perf_model is not None \
            else DEFAULT_BOUNDARY_TOKENS
        self.learning_rate = learning_rate
        # Measured / predicted time of compute-bound and of memory-bound prefill steps (EWMA).
        self.compute_scale = self.memory_scale = 1.0
        self.num_observed = 0
        self._scaled = perf_model  # the model with both scales applied
        self._scaled_at = (1.0, 1.0)

    def tokens(self, history: int = 0) -> float:
        """L_m(H): new tokens from which a prefill on `history` cached tokens is compute-bound
        (inf when it never is)."""
        if self.fixed_tokens is not None:
            return float(self.fixed_tokens)
        assert self._scaled is not None
        if self._scaled.tables is not None:
            # Measured tables: L_m = (one-token prefill's cost) / (GEMM seconds per token), so a
            # device whose memory is slower than measured moves it up, slower compute down.
            return self._scaled.prefill_boundary(history) * self.memory_scale / self.compute_scale
        return self._scaled.prefill_boundary(history)  # a closed form: cheap per request

    def observe(self, prefill_tokens: int, history: int, seconds: float) -> None:
        """A measured step that ran one prefill of `prefill_tokens` on `history` cached
        tokens and nothing else: refit the bounding term's scale (see the module docstring)."""
        model = self.perf_model
        if model is None or self.fixed_tokens is not None or prefill_tokens <= 0 \
                or not (math.isfinite(seconds) and seconds > 0):
            return
        rate = self.learning_rate
        if model.tables is not None:
            # The tables' step is a sum, not a max: the whole predicted step is the term, and the
            # (scaled) boundary says which regime it ran in.
            predicted = model.prefill_time(history, prefill_tokens)
            if predicted > 0:
                if prefill_tokens >= self.tokens(history):
                    self.compute_scale += rate * (seconds / predicted - self.compute_scale)
                else:
                    self.memory_scale += rate * (seconds / predicted - self.memory_scale)
                self.num_observed += 1
            return
        compute, memory = model.prefill_terms(history, prefill_tokens)
        # Which term bounds the step by the *scaled* model: the scales move the ridge.
        if compute * self.compute_scale >= memory * self.memory_scale:
            if compute > 0:
                self.compute_scale += rate * (seconds / compute - self.compute_scale)
        elif memory > 0:
            self.memory_scale += rate * (seconds / memory - self.memory_scale)
        self.num_observed += 1
        c, m = self._scaled_at
        if abs(self.compute_scale / c - 1) > 0.01 or abs(self.memory_scale / m - 1) > 0.01:
            p = model.prefill
            self._scaled = replace(model, prefill=replace(
                p, c0=p.c0 * self.compute_scale, c_tok=p.c_tok * self.compute_scale,
                c_attn=p.c_attn * self.compute_scale, m0=p.m0 * self.memory_scale,
                m_tok=p.m_tok * self.memory_scale, m_hist=p.m_hist * self.memory_scale))
            self._scaled_at = (self.compute_scale, self.memory_scale)

    def observe_step(self, prefill_chunks: tuple[tuple[int, int], ...], num_decodes: int, seconds: float) -> None:
        """`observe` for a step's shape ((l_hist, l_incr) per prefill): only one prefill alone counts."""
        if len(prefill_chunks) == 1 and num_decodes == 0:
            history, tokens = prefill_chunks[0]
            self.observe(tokens, history, seconds)

    def is_short(self, new_tokens: int, history: int = 0) -> bool:
        """Whether a (re-)prefill of `new_tokens` on `history` cached tokens is short: L < L_m(H)."""
        return new_tokens < self.tokens(history)

    def describe(self) -> dict[str, float]:
        """L_m at a few histories (-1: never compute-bound) and the refit's scales."""
        points = {f"l_m_h{h}": self.tokens(h) for h in (0, 1024, 8192)}
        return {**{k: (v if math.isfinite(v) else -1.0) for k, v in points.items()},
                "compute_scale": self.compute_scale, "memory_scale": self.memory_scale,
                "observed_steps": float(self.num_observed)}
