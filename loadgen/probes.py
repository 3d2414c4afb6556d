"""How big a rate probe is, and whether it measured a steady state.

A probe of a rate sweep or capacity search is one run at a fixed arrival rate. Sending a
fixed number of requests makes its arrival window shrink as the rate grows, until every
request fits in one batch and any rate "passes"; so a probe offers a window of arrivals
instead: ``probe_count(rate, window_s, min_requests)`` requests.

A probe only says something about the rate when the cluster reached its steady state
under it. :func:`steady_state` checks two concrete signs that it did not:

* **short window**: the arrival window is shorter than ``WINDOW_E2E_MULTIPLE`` (2) times
  the probe's median end-to-end latency. The cluster fills up to its steady load
  (rate x E2E requests in flight, by Little's law) over about one E2E; in a window
  shorter than two, most arrivals never meet that load, and a rate the cluster cannot
  hold may still pass.
* **growing queue**: the SLO attainment of the later half of the arrivals (by arrival
  time) is more than ``ATTAINMENT_DROP`` (10 points) below the earlier half's: latency
  is still rising when the arrivals stop, so a longer run would score worse.

Pure: plain results in, plain data out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from loadgen.metrics import RequestResult, Slo, meets_slo

__all__ = ["WINDOW_E2E_MULTIPLE", "ATTAINMENT_DROP", "probe_count", "SteadyState", "steady_state"]

WINDOW_E2E_MULTIPLE = 2.0
ATTAINMENT_DROP = 0.10
# Fewer results than this cannot be split into two halves worth comparing.
_MIN_RESULTS_FOR_HALVES = 4


def probe_count(rate: float, window_s: float, min_requests: int) -> int:
    """Requests a probe at ``rate`` per second sends: ``max(min_requests, ceil(rate * window_s))``."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate: must be a finite number > 0, got {rate!r}")
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"--probe-window: must be a finite number of seconds > 0, got {window_s!r}")
    if min_requests < 1:
        raise ValueError(f"--min-requests: must be >= 1, got {min_requests}")
    # The 1e-9 keeps a product that floating point puts a hair above an integer (0.1 * 30) at it.
    return max(min_requests, math.ceil(rate * window_s - 1e-9))


@dataclass(frozen=True)
class SteadyState:
    """Whether a probe reached a steady state (``steady``), why not (``reasons``), and the figures."""

    steady: bool
    reasons: tuple[str, ...]
    arrival_window_s: float
    median_e2e_s: float
    attainment_earlier_half: float
    attainment_later_half: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (NaN, an undefined figure, becomes None)."""
        return {k: (list(v) if isinstance(v, tuple) else None if isinstance(v, float) and not math.isfinite(v)
                    else v) for k, v in asdict(self).items()}

    def describe(self) -> str:
        """One line for the console."""
        return "; ".join(self.reasons) if self.reasons else "steady"


def _attainment(results: Sequence[RequestResult], slo: Slo) -> float:
    return sum(meets_slo(r, slo) for r in results) / len(results) if results else math.nan


def steady_state(results: Sequence[RequestResult], slo: Slo) -> SteadyState:
    """Check one probe's results against the criteria of the module docstring."""
    ordered = sorted(results, key=lambda r: r.arrival_s)
    window = ordered[-1].arrival_s - ordered[0].arrival_s if ordered else math.nan
    e2es = [r.e2e_s for r in ordered if r.ok]
    median_e2e = float(np.median(e2es)) if e2es else math.nan
    reasons = []
    if math.isfinite(median_e2e) and window < WINDOW_E2E_MULTIPLE * median_e2e:
        reasons.append(f"short window: arrivals span {window:.3g} s, under {WINDOW_E2E_MULTIPLE:g}x the median "
                       f"E2E latency of {median_e2e:.3g} s")
    earlier = later = math.nan
    if len(ordered) >= _MIN_RESULTS_FOR_HALVES:
        half = len(ordered) // 2
        earlier, later = _attainment(ordered[:half], slo), _attainment(ordered[half:], slo)
        if later < earlier - ATTAINMENT_DROP:
            reasons.append(f"growing queue: SLO attainment fell from {earlier:.0%} (earlier half of the arrivals) "
                           f"to {later:.0%} (later half)")
    return SteadyState(not reasons, tuple(reasons), window, median_e2e, earlier, later)
