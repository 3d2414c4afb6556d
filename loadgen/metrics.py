"""Per-request results, serving metrics, SLO goodput and capacity search.

Definitions (all times in seconds, on one clock shared by every field):

* TTFT = ``first_token_s - arrival_s``; reported overall, for initial requests
  (``round_index == 0``: plain requests and first session rounds) and for incremental
  session rounds (``round_index > 0``) separately.
* ITL = every gap between consecutive entries of ``token_times_s`` (one entry per output
  token, the first being the first token), pooled over requests. Tokens delivered in
  one chunk share a timestamp and give zero gaps: that is what a client sees.
* TPOT (per request) = ``(end_s - first_token_s) / (output_len - 1)``, requests with >= 2 tokens.
* per-request TBT p99 = the p99 of that request's own ITL gaps; its distribution over requests.
* E2E = ``end_s - arrival_s``.
* span = last ``end_s`` - first ``arrival_s`` over all requests (failed ones included);
  throughputs and goodput divide by it.
* A request *meets the SLO* when it succeeded, TTFT <= the TTFT limit (the incremental
  limit for rounds > 0, if set) and its per-request TBT p99 <= ``Slo.itl_s``. The p99 --
  not the max, which one preemption or GC pause decides, and not the mean TPOT, which
  hides stalls -- is what a user feels as steady streaming. Requests with < 2 tokens
  have no gaps and pass the TBT part.
* With ``Slo.max_gap_s`` set, a request also misses when any single gap exceeds it: a
  stall, such as waiting for a decode slot after a disaggregated prefill, which one
  request's p99 over hundreds of gaps would not show. Such a wait is a second TTFT to the
  user, so a natural limit is the TTFT limit.
* goodput = output tokens per second of requests meeting the SLO; attainment = their
  fraction of *all* requests (a failed request is a miss).
* Latency distributions cover successful requests only. Percentiles use numpy's
  ``"linear"`` method (type 7: linear interpolation between closest ranks).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "PERCENTILE_METHOD",
    "RequestResult",
    "Slo",
    "Distribution",
    "Summary",
    "meets_slo",
    "summarize",
    "Probe",
    "CapacityResult",
    "find_capacity",
]

PERCENTILE_METHOD = "linear"
_NAN = float("nan")


@dataclass
class RequestResult:
    """What the load generator observed for one request (or one session round)."""

    request_id: str
    session_id: str | None
    round_index: int
    arrival_s: float
    first_token_s: float | None
    token_times_s: list[float]
    end_s: float
    prompt_len: int
    output_len: int
    ok: bool
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None when no token arrived."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itls_s(self) -> np.ndarray:
        """Gaps between consecutive output tokens."""
        return np.diff(np.asarray(self.token_times_s, dtype=np.float64))

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, or None with < 2 tokens."""
        if self.first_token_s is None or self.output_len < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_len - 1)

    @property
    def tbt_p99_s(self) -> float | None:
        """p99 of this request's own token gaps, or None with < 2 tokens."""
        gaps = self.itls_s
        return float(np.percentile(gaps, 99, method=PERCENTILE_METHOD)) if gaps.size else None

    @property
    def max_gap_s(self) -> float | None:
        """Longest gap between consecutive tokens, or None with < 2 tokens."""
        gaps = self.itls_s
        return float(gaps.max()) if gaps.size else None

    @property
    def e2e_s(self) -> float:
        """End-to-end latency."""
        return self.end_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in seconds; ``incremental_ttft_s`` (if set) applies to rounds > 0."""

    ttft_s: float
    itl_s: float
    incremental_ttft_s: float | None = None
    max_gap_s: float | None = None  # longest single stall between tokens; None: not checked

    def ttft_limit(self, round_index: int) -> float:
        """The TTFT limit for a request of this session round."""
        if round_index > 0 and self.incremental_ttft_s is not None:
            return self.incremental_ttft_s
        return self.ttft_s


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, mean and p50/p90/p95/p99/max of a sample (NaN when empty)."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray) -> Distribution:
        """Summarise ``values``."""
        x = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=np.float64)
        if x.size == 0:
            return cls(0, _NAN, _NAN, _NAN, _NAN, _NAN, _NAN)
        p50, p90, p95, p99 = np.percentile(x, [50, 90, 95, 99], method=PERCENTILE_METHOD)
        return cls(int(x.size), float(x.mean()), float(p50), float(p90), float(p95), float(p99), float(x.max()))


@dataclass(frozen=True)
class Summary:
    """Aggregate metrics of a run; see the module docstring for every definition."""

    slo: Slo
    n_requests: int
    n_ok: int
    n_failed: int
    n_meeting_slo: int
    span_s: float
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    goodput_tokens_per_s: float
    goodput_requests_per_s: float
    slo_attainment: float
    ttft: Distribution
    ttft_initial: Distribution
    ttft_incremental: Distribution
    itl: Distribution
    tpot: Distribution
    tbt_p99: Distribution
    e2e: Distribution
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able nested dict; NaN (undefined, e.g. empty samples) becomes None."""
        return _nan_to_none(asdict(self))


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """True when the request succeeded within its TTFT limit, its TBT p99 <= ``slo.itl_s``
    and (if set) no gap > ``slo.max_gap_s``."""
    if not result.ok or result.ttft_s is None:
        return False
    if result.ttft_s > slo.ttft_limit(result.round_index):
        return False
    if slo.max_gap_s is not None and (gap := result.max_gap_s) is not None and gap > slo.max_gap_s:
        return False
    tbt = result.tbt_p99_s
    return tbt is None or tbt <= slo.itl_s


def summarize(results: Sequence[RequestResult], slo: Slo) -> Summary:
    """Compute every metric of a run from its per-request results."""
    ok = [r for r in results if r.ok]
    good = [r for r in ok if meets_slo(r, slo)]
    if results:
        span = max(r.end_s for r in results) - min(r.arrival_s for r in results)
    else:
        span = _NAN

    def rate(amount: float) -> float:
        return amount / span if span > 0 else _NAN

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or "unknown"
            errors[key] = errors.get(key, 0) + 1

    ttfts = [(r.round_index, r.ttft_s) for r in ok if r.ttft_s is not None]
    itl_parts = [r.itls_s for r in ok]
    return Summary(
        slo=slo,
        n_requests=len(results),
        n_ok=len(ok),
        n_failed=len(results) - len(ok),
        n_meeting_slo=len(good),
        span_s=span,
        request_throughput=rate(len(ok)),
        input_token_throughput=rate(sum(r.prompt_len for r in ok)),
        output_token_throughput=rate(sum(r.output_len for r in ok)),
        goodput_tokens_per_s=rate(sum(r.output_len for r in good)),
        goodput_requests_per_s=rate(len(good)),
        slo_attainment=len(good) / len(results) if results else _NAN,
        ttft=Distribution.of(t for _, t in ttfts),
        ttft_initial=Distribution.of(t for i, t in ttfts if i == 0),
        ttft_incremental=Distribution.of(t for i, t in ttfts if i > 0),
        itl=Distribution.of(np.concatenate(itl_parts) if itl_parts else np.zeros(0)),
        tpot=Distribution.of(t for r in ok if (t := r.tpot_s) is not None),
        tbt_p99=Distribution.of(t for r in ok if (t := r.tbt_p99_s) is not None),
        e2e=Distribution.of(r.e2e_s for r in ok),
        errors=errors,
    )


@dataclass(frozen=True, slots=True)
class Probe:
    """One measurement of the capacity search."""

    rate: float
    attainment: float
    passed: bool


@dataclass(frozen=True)
class CapacityResult:
    """Highest passing rate found, the bracket around the true capacity, and every probe.

    ``rate`` is the highest probed rate that met the target (0.0 if none did);
    ``fail_rate`` the lowest probed rate that missed it (inf if none did);
    ``converged`` is whether ``fail_rate - rate <= tol`` within the probe budget;
    ``capped`` is whether the search passed at its ``max_rate`` and stopped there, so the
    capacity is at least ``rate``.
    """

    rate: float
    fail_rate: float
    converged: bool
    probes: list[Probe]
    capped: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (an unbounded ``fail_rate`` becomes None)."""
        return _nan_to_none(
            {
                "rate": self.rate,
                "fail_rate": self.fail_rate,
                "converged": self.converged,
                "capped": self.capped,
                "probes": [asdict(p) for p in self.probes],
            }
        )


def find_capacity(
    measure: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    tol: float = 0.1,
    max_iters: int = 16,
    max_rate: float | None = None,
) -> CapacityResult:
    """Highest rate with ``measure(rate) >= target``, assuming attainment falls as rate rises.

    Probes ``lo`` (halving until a rate passes), then ``hi`` (doubling until a rate
    fails, never beyond ``max_rate``), then bisects the bracket until it is at most ``tol``
    wide (absolute, in rate units). ``max_iters`` caps the number of ``measure`` calls,
    each usually a whole benchmark run; ``max_rate`` caps their cost, which grows with
    the rate, when the system never fails (or its SLO cannot see it fail).
    """
    if not 0 < lo < hi or not math.isfinite(hi):
        raise ValueError(f"lo/hi: need 0 < lo < hi < inf, got lo={lo}, hi={hi}")
    if max_rate is not None and not max_rate >= hi:
        raise ValueError(f"max_rate: must be >= hi ({hi}), got {max_rate}")
    if not tol > 0:
        raise ValueError(f"tol: must be > 0, got {tol}")
    if max_iters < 1:
        raise ValueError(f"max_iters: must be >= 1, got {max_iters}")

    probes: list[Probe] = []

    def passes(rate: float) -> bool:
        attainment = float(measure(rate))
        probes.append(Probe(rate, attainment, attainment >= target))
        return probes[-1].passed

    good, bad = 0.0, math.inf
    # 1. Find a passing rate at or below lo.
    rate = lo
    while len(probes) < max_iters:
        if passes(rate):
            good = rate
            break
        bad = rate
        if bad <= tol:
            # Even a near-zero rate misses: the capacity is below the resolution asked for.
            break
        rate /= 2
    # 2. Find a failing rate at or above hi.
    rate = hi
    capped = False
    while good > 0 and math.isinf(bad) and len(probes) < max_iters:
        if passes(rate):
            good = rate
            if max_rate is not None and rate >= max_rate:
                capped = True
                break
            rate = rate * 2 if max_rate is None else min(rate * 2, max_rate)
        else:
            bad = rate
    # 3. Bisect.
    while good > 0 and math.isfinite(bad) and bad - good > tol and len(probes) < max_iters:
        mid = (good + bad) / 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    converged = bad - good <= tol
    return CapacityResult(rate=good, fail_rate=bad, converged=converged, probes=probes, capped=capped)
