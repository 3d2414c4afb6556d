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
"""

from __future__ import annotations

import math

from splitserve.perf_model import PerfModel

__all__ = ["DEFAULT_BOUNDARY_TOKENS", "LengthBoundary"]

# Without a performance model: LAPS §2.1 measures the boundary at 150-512 tokens on current GPUs.
DEFAULT_BOUNDARY_TOKENS = 256


class LengthBoundary:
    """L_m(H) from a performance model (or a fixed count), and the class of a (re-)prefill."""

    __slots__ = ("perf_model", "fixed_tokens")

    def __init__(self, perf_model: PerfModel | None = None, fixed_tokens: int | None = None):
        if fixed_tokens is not None and fixed_tokens < 1:
            raise ValueError(f"boundary_tokens must be >= 1, got {fixed_tokens}")
        self.perf_model = perf_model
        self.fixed_tokens = fixed_tokens if fixed_tokens is not None or perf_model is not None \
            else DEFAULT_BOUNDARY_TOKENS

    def tokens(self, history: int = 0) -> float:
        """L_m(H): new tokens from which a prefill on `history` cached tokens is compute-bound
        (inf when it never is)."""
        if self.fixed_tokens is not None:
            return float(self.fixed_tokens)
        assert self.perf_model is not None
        return self.perf_model.prefill_boundary(history)  # a closed form: cheap per request

    def is_short(self, new_tokens: int, history: int = 0) -> bool:
        """Whether a (re-)prefill of `new_tokens` on `history` cached tokens is short: L < L_m(H)."""
        return new_tokens < self.tokens(history)

    def describe(self) -> dict[str, float | str]:
        """L_m at a few histories, for `splitserve status` and the metrics."""
        source = "fixed" if self.fixed_tokens is not None else "perf_model"
        points = {f"l_m_h{h}": self.tokens(h) for h in (0, 1024, 8192)}
        return {"source": source, **{k: (v if math.isfinite(v) else -1.0) for k, v in points.items()}}
