"""`splitserve chaos`'s options and their checks."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # splitserve.tls imports grpc; `splitserve simulate` mounts this module without it
    from splitserve.tls import ClientTls


WORKER, COORDINATOR, REDIS = "worker", "coordinator", "redis"
FAULT_KINDS = (WORKER, COORDINATOR, REDIS)
# Retried by the chaos client, as a careful client would: the service is momentarily gone or
# overloaded, or one attempt hung past its own deadline. Anything else fails the request.
DEFAULT_RETRIABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED")
POLL_S = 0.1


class ChaosError(RuntimeError):
    """The chaos run cannot start or go on (bad options, the cluster not found or not healthy)."""


@dataclass(frozen=True)
class ChaosOptions:
    """One chaos run. Times are seconds; counts bound the run."""

    target: str = "127.0.0.1:50051"  # the gateway's gRPC address (loopback only)
    redis_url: str = "redis://127.0.0.1:6379/0"  # the cluster's Redis (loopback only)
    redis_prefix: str = "ss:"  # the cluster's prefix: it names the cluster's processes
    seed: int = 0
    duration_s: float = 60.0  # traffic and faults; faults fall in [warmup_s, duration_s - settle_s]
    warmup_s: float = 3.0
    settle_s: float = 5.0
    worker_kills: int = 3
    coordinator_kills: int = 0
    redis_kills: int = 0
    rate: float = 4.0  # requests per second (Poisson)
    max_concurrency: int = 64  # requests in flight at most (later arrivals wait)
    cases: int = 12  # distinct (prompt, sampling) cases; every request repeats one of them
    sampled_fraction: float = 0.5  # the share of cases sampled with a fixed seed (the rest greedy)
    temperature: float = 0.8
    prompt_words: tuple[int, int] = (4, 24)
    max_tokens: tuple[int, int] = (16, 48)
    max_attempts: int = 6
    attempt_timeout_s: float = 60.0
    backoff_s: float = 0.25  # before retry n: backoff_s * 2**(n-1), at most 4 s (or the server's Retry-After)
    retriable: tuple[str, ...] = DEFAULT_RETRIABLE
    recovery_timeout_s: float = 90.0  # a killed service must be back within this
    min_live_workers: int = 1  # a worker is killed only while more than this many others are up
    drain_timeout_s: float = 120.0  # after the traffic, the longest wait for requests still running
    api_key: str | None = None
    gateway_tls: ClientTls | None = None  # TLS to the gateway (None: plaintext)
    internal_tls: ClientTls | None = None  # mTLS to the internal services' health checks (None: plaintext)

    def __post_init__(self) -> None:
        _require_loopback("target", f"//{self.target}" if "://" not in self.target else self.target)
        _require_loopback("redis_url", self.redis_url)
        if not self.redis_prefix:
            raise ValueError("redis_prefix: must not be empty (it names the cluster's processes)")
        for name in ("worker_kills", "coordinator_kills", "redis_kills"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("duration_s", "rate", "attempt_timeout_s", "recovery_timeout_s", "drain_timeout_s",
                     "temperature", "backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.warmup_s < 0 or self.settle_s < 0 or self.warmup_s + self.settle_s >= self.duration_s:
            raise ValueError(f"warmup_s ({self.warmup_s}) + settle_s ({self.settle_s}) must be >= 0 and leave "
                             f"time for faults within duration_s ({self.duration_s})")
        if self.min_live_workers < 0:
            raise ValueError(f"min_live_workers: must be >= 0, got {self.min_live_workers}")
        for name in ("max_concurrency", "cases", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.sampled_fraction <= 1:
            raise ValueError(f"sampled_fraction: must be in [0, 1], got {self.sampled_fraction}")
        for name in ("prompt_words", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got ({lo}, {hi})")
        unknown = [code for code in self.retriable if code not in _status_names()]
        if unknown:
            raise ValueError(f"retriable: unknown gRPC status {unknown[0]!r}")

    @property
    def faults(self) -> int:
        return self.worker_kills + self.coordinator_kills + self.redis_kills


def _require_loopback(name: str, url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{name}: chaos sends traffic to this machine's loopback only (127.0.0.1, ::1, "
                         f"localhost); got host {host!r}")


def _status_names() -> frozenset[str]:
    import grpc  # here, not at import: `splitserve simulate` (same CLI) must run without grpc

    return frozenset(code.name for code in grpc.StatusCode)
