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

from splitserve.perf.model import PerfModel

__all__ = ["DEFAULT_BOUNDARY_TOKENS", "LengthBoundary"]

# Without a performance model: LAPS §2.1 measures the boundary at 150-512 tokens on current GPUs.
DEFAULT_BOUNDARY_TOKENS = 256


class LengthBoundary:
    """L_m(H) from a performance model (or a fixed count), and the class of a (re-)prefill."""

    __slots__ = ("perf_model", "fixed_tokens", "learning_rate", "compute_scale", "memory_scale",
                 "num_observed")

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

    def tokens(self, history: int = 0) -> float:
        """L_m(H): new tokens from which a prefill on `history` cached tokens is compute-bound
        (inf when it never is); a closed form or a table lookup, cheap per request."""
        if self.fixed_tokens is not None:
            return float(self.fixed_tokens)
        assert self.perf_model is not None
        return self.perf_model.prefill_boundary(history, compute_scale=self.compute_scale,
                                                memory_scale=self.memory_scale)

    def observe(self, prefill_tokens: int, history: int, seconds: float) -> None:
        """A measured step that ran one prefill of `prefill_tokens` on `history` cached
        tokens and nothing else: refit the bounding term's scale (see the module docstring)."""
        model = self.perf_model
        if model is None or self.fixed_tokens is not None or prefill_tokens <= 0 \
                or not (math.isfinite(seconds) and seconds > 0):
            return
        regime, predicted = model.prefill_bounding_term(
            history, prefill_tokens, compute_scale=self.compute_scale, memory_scale=self.memory_scale)
        if predicted <= 0:
            return
        rate = self.learning_rate
        if regime == "compute":
            self.compute_scale += rate * (seconds / predicted - self.compute_scale)
        else:
            self.memory_scale += rate * (seconds / predicted - self.memory_scale)
        self.num_observed += 1

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
