"""Arrival processes: when requests (or sessions) are sent, as offsets in seconds.

Every process answers ``offsets(n, rng)``: ``n`` absolute send offsets in seconds,
non-decreasing, with ``offsets[0] == 0.0`` (the first arrival defines time zero, as in
vLLM's benchmark, which sends its first request immediately). The ``n - 1`` gaps after
it follow the process's inter-arrival distribution, so the empirical rate of a run is
``(n - 1) / offsets[-1]``.

A rate of ``inf`` is allowed for the synthetic processes and means "all at once"
(every offset is 0), matching vLLM's ``--request-rate inf``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "ArrivalProcess",
    "PoissonArrivals",
    "GammaArrivals",
    "ConstantArrivals",
    "TraceArrivals",
    "poisson",
    "gamma",
    "constant",
    "trace",
    "parse_arrival",
]


class ArrivalProcess(ABC):
    """A source of non-decreasing send offsets (seconds) starting at 0."""

    @abstractmethod
    def offsets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Return ``n`` non-decreasing float64 offsets in seconds, the first being 0."""


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n: must be a non-negative integer, got {n!r}")
    return int(n)


def _check_positive(field: str, value: float) -> float:
    value = float(value)
    # NaN fails every comparison, so test the accepted range rather than the rejected one.
    if not value > 0:
        raise ValueError(f"{field}: must be > 0, got {value!r}")
    return value


def _offsets_from_gaps(gaps: np.ndarray) -> np.ndarray:
    """Turn ``n - 1`` gaps into ``n`` offsets starting at 0."""
    out = np.zeros(len(gaps) + 1, dtype=np.float64)
    np.cumsum(gaps, out=out[1:])
    return out


@dataclass(frozen=True)
class PoissonArrivals(ArrivalProcess):
    """Poisson process: exponential gaps with mean ``1 / rate`` (CV = 1)."""

    rate: float

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)

    def offsets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        n = _check_n(n)
        if n == 0:
            return np.zeros(0)
        return _offsets_from_gaps(rng.exponential(1.0 / self.rate, size=n - 1))


@dataclass(frozen=True)
class GammaArrivals(ArrivalProcess):
    """Gamma gaps, vLLM convention: shape = burstiness, scale = 1/(rate*burstiness).

    The mean gap stays ``1 / rate`` whatever the burstiness; the coefficient of
    variation is ``1 / sqrt(burstiness)``: burstiness 1 is Poisson, < 1 is burstier,
    > 1 is smoother (tending to constant).
    """

    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)
        _check_positive("burstiness", self.burstiness)
        if math.isinf(self.burstiness):
            raise ValueError("burstiness: must be finite (use constant arrivals instead)")

    def offsets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        n = _check_n(n)
        if n == 0:
            return np.zeros(0)
        scale = 1.0 / (self.rate * self.burstiness)
        return _offsets_from_gaps(rng.gamma(self.burstiness, scale, size=n - 1))


@dataclass(frozen=True)
class ConstantArrivals(ArrivalProcess):
    """Evenly spaced arrivals, exactly ``1 / rate`` apart (CV = 0)."""

    rate: float

    def __post_init__(self) -> None:
        _check_positive("rate", self.rate)

    def offsets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        n = _check_n(n)
        # Divide instead of accumulating gaps so offset i is i / rate correctly rounded, without drift.
        return np.arange(n, dtype=np.float64) / self.rate


@dataclass(frozen=True)
class TraceArrivals(ArrivalProcess):
    """Replay recorded timestamps; ``time_scale`` is a speed-up (2.0 = twice as fast).

    Offset i is ``(timestamps[i] - timestamps[0]) / time_scale``. Asking for more
    arrivals than the trace holds is an error rather than a silent wrap-around.
    """

    timestamps: tuple[float, ...]
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("time_scale", self.time_scale)
        if math.isinf(self.time_scale):
            raise ValueError("time_scale: must be finite")
        ts = np.asarray(self.timestamps, dtype=np.float64)
        if ts.ndim != 1 or not np.all(np.isfinite(ts)):
            raise ValueError("timestamps: must be a flat sequence of finite numbers")
        if np.any(np.diff(ts) < 0):
            raise ValueError("timestamps: must be non-decreasing")

    def offsets(self, n: int, rng: np.random.Generator) -> np.ndarray:
        n = _check_n(n)
        if n > len(self.timestamps):
            raise ValueError(f"n: trace holds {len(self.timestamps)} arrivals, asked for {n}")
        ts = np.asarray(self.timestamps[:n], dtype=np.float64)
        if n == 0:
            return ts
        return (ts - ts[0]) / self.time_scale


def poisson(rate: float) -> PoissonArrivals:
    """Poisson arrivals at ``rate`` requests per second."""
    return PoissonArrivals(rate)


def gamma(rate: float, burstiness: float = 1.0) -> GammaArrivals:
    """Gamma arrivals at ``rate`` per second with CV ``1 / sqrt(burstiness)``."""
    return GammaArrivals(rate, burstiness)


def constant(rate: float) -> ConstantArrivals:
    """Evenly spaced arrivals at ``rate`` per second."""
    return ConstantArrivals(rate)


def trace(timestamps: Sequence[float], time_scale: float = 1.0) -> TraceArrivals:
    """Replay ``timestamps`` (seconds), sped up by ``time_scale``."""
    return TraceArrivals(tuple(float(t) for t in timestamps), float(time_scale))


# kind -> (required fields, optional fields with defaults)
_SPEC_FIELDS: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "poisson": (("rate",), {}),
    "gamma": (("rate",), {"burstiness": 1.0}),
    "constant": (("rate",), {}),
    "trace": (("path",), {"time_scale": 1.0}),
}


def parse_arrival(spec: str) -> ArrivalProcess:
    """Parse a CLI spec like ``poisson:rate=4`` or ``gamma:rate=4,burstiness=0.5``.

    Also accepts ``trace:path=FILE,time_scale=2`` (reads the trace's timestamps).
    Errors are ``ValueError`` naming the offending field.
    """
    kind, _, body = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in _SPEC_FIELDS:
        raise ValueError(f"kind: unknown arrival process {kind!r} (expected one of {sorted(_SPEC_FIELDS)})")
    required, optional = _SPEC_FIELDS[kind]
    raw: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq:
            raise ValueError(f"{key}: expected key=value, got {item!r}")
        if key not in required and key not in optional:
            raise ValueError(f"{key}: unknown field for {kind} (expected {list(required) + list(optional)})")
        if key in raw:
            raise ValueError(f"{key}: given twice")
        raw[key] = value.strip()
    for key in required:
        if key not in raw:
            raise ValueError(f"{key}: required for {kind}")

    if kind == "trace":
        # Imported here so the arrival module itself stays free of file formats.
        from loadgen.traces import read_trace

        return trace([r.arrival_s for r in read_trace(raw["path"])], _parse_float("time_scale", raw.get("time_scale", "1")))
    values = {key: _parse_float(key, raw[key]) if key in raw else default for key, default in optional.items()}
    values.update({key: _parse_float(key, raw[key]) for key in required})
    constructors = {"poisson": PoissonArrivals, "gamma": GammaArrivals, "constant": ConstantArrivals}
    return constructors[kind](**values)


def _parse_float(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field}: not a number: {text!r}") from None
