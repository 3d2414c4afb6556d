"""Reaching Redis: retrying clients, a bounded wait-until-reachable, one error type.

Used by `splitserve.state.store`; callers catch `StateUnavailableError` (re-exported there).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Concatenate, ParamSpec, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger("splitserve.state.store")


class StateUnavailableError(RuntimeError):
    """Redis could not be reached within the configured attempts."""

    def __init__(self, url: str, attempts: int, last_error: BaseException | None) -> None:
        self.url = url
        self.attempts = attempts
        self.last_error = last_error
        super().__init__(
            f"Redis state store at {url} unavailable after {attempts} attempt(s): "
            f"{type(last_error).__name__}: {last_error}"
        )


@dataclass(frozen=True)
class RedisRetryPolicy:
    """How hard to try: startup attempts with capped exponential backoff, command retries."""

    attempts: int = 5  # PINGs before connect() gives up
    base_delay_s: float = 0.1  # first backoff; doubles per attempt
    max_delay_s: float = 2.0  # backoff cap (startup and reconnects)
    reconnect_retries: int = 3  # redis-py retries of one command on connection/timeout errors
    socket_timeout_s: float = 5.0  # connect and read timeout

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.reconnect_retries < 0:
            raise ValueError(f"need attempts >= 1 and reconnect_retries >= 0, got {self}")
        if not 0 <= self.base_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 <= base_delay_s <= max_delay_s, got {self}")

    def delay_after(self, attempt: int) -> float:
        """Backoff before attempt + 1 (attempt counts from 1)."""
        return min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))


def redact_url(url: str) -> str:
    """The URL without credentials, for logs and error messages."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def make_client(url: str, policy: RedisRetryPolicy, *, decode_responses: bool) -> aioredis.Redis:
    """A client whose commands survive a Redis restart: reconnect with jittered backoff."""
    retry = Retry(
        ExponentialWithJitterBackoff(base=policy.base_delay_s, cap=policy.max_delay_s),
        policy.reconnect_retries,
    )
    # A blocking pool: under a burst, commands wait for a free connection instead of
    # failing with "too many connections" (which surfaced as INTERNAL to clients).
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=128,
        timeout=policy.socket_timeout_s,
        decode_responses=decode_responses,
        socket_timeout=policy.socket_timeout_s,
        socket_connect_timeout=policy.socket_timeout_s,
        retry=retry,
        health_check_interval=30,
    )
    return aioredis.Redis(connection_pool=pool)


async def wait_until_reachable(url: str, policy: RedisRetryPolicy) -> None:
    """PING until Redis answers; raise StateUnavailableError after policy.attempts tries."""
    last_error: BaseException | None = None
    for attempt in range(1, policy.attempts + 1):
        # A probe without redis-py retries: they would multiply the attempt budget and
        # make an unreachable Redis slow to report.
        probe = aioredis.Redis.from_url(
            url,
            socket_timeout=policy.socket_timeout_s,
            socket_connect_timeout=policy.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            await probe.ping()
            return
        except AuthenticationError as exc:  # wrong credentials do not heal by waiting
            raise StateUnavailableError(redact_url(url), attempt, exc) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            last_error = exc
            if attempt == policy.attempts:
                break
            delay = policy.delay_after(attempt)
            logger.warning(
                "Redis at %s unreachable (attempt %d/%d: %s); retrying in %.2f s",
                redact_url(url), attempt, policy.attempts, exc, delay,
            )
            await asyncio.sleep(delay)
        finally:
            await probe.aclose()
    raise StateUnavailableError(redact_url(url), policy.attempts, last_error)


class _HasRetryPolicy(Protocol):
    url: str
    retry_policy: RedisRetryPolicy


_S = TypeVar("_S", bound=_HasRetryPolicy)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def unavailable_on_connection_error(
    method: Callable[Concatenate[_S, _P], Awaitable[_R]],
) -> Callable[Concatenate[_S, _P], Awaitable[_R]]:
    """Method decorator: connection errors left after redis-py's retries -> StateUnavailableError."""

    @functools.wraps(method)
    async def wrapper(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await method(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            attempts = self.retry_policy.reconnect_retries + 1
            raise StateUnavailableError(self.url, attempts, exc) from exc

    return wrapper
