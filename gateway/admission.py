"""Bounded admission: a concurrency limit with a waiting queue ordered by priority, then
arrival (FIFO among equals), and overload hints.

Priority is the request's `priority`, a lower value first as in vLLM's `--scheduling-policy
priority` and the workers' queues (`splitserve.core.policy.priority_key`); it is non-zero only where the cluster
runs the priority policy (`gateway/priority_check.py` refuses it elsewhere), so under fcfs the
queue is plain FIFO. A full queue admits a newcomer that outranks its last waiter by refusing
that waiter (429 with a retry hint) instead of the newcomer."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import math
import time
from typing import AsyncIterator, Callable

from splitserve.errors import Overloaded, Unavailable

MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 60.0


class _Waiter:
    """A queued request: ordered by priority (lower first), then arrival."""

    __slots__ = ("key", "future", "priority")

    def __init__(self, priority: int, seq: int, future: asyncio.Future[None]):
        self.key = (priority, seq)
        self.priority = priority
        self.future = future

    def __lt__(self, other: _Waiter) -> bool:
        return self.key < other.key


class Admission:
    """At most `max_concurrent` requests in flight; up to `max_queued` more wait, the lowest
    priority value first and FIFO among equals.

    A request that finds the queue full, or waits longer than `queue_timeout_s`, gets
    `Overloaded` with a retry hint estimated from the recent completion rate.
    """

    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float, *,
                 clock: Callable[[], float] = time.monotonic, rate_window_s: float = 30.0):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent}")
        if max_queued < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued}")
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self.rate_window_s = rate_window_s
        self.in_flight = 0
        self._waiters: list[_Waiter] = []  # sorted: the next to admit first
        self._arrivals = itertools.count()
        self._completions: collections.deque[float] = collections.deque()
        self._admitting = True
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return sum(1 for w in self._waiters if not w.future.done())

    @property
    def admitting(self) -> bool:
        return self._admitting

    @contextlib.asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        """Hold one in-flight slot for the body of the `async with`."""
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int = 0) -> None:
        """Wait for a slot; Overloaded when the queue is full of requests ranking at least as
        high (a priority value no larger) or the wait times out."""
        if not self._admitting:
            raise Unavailable("gateway is shutting down; retry on another replica")
        if self.in_flight < self.max_concurrent and not self.queued:
            self._take()
            return
        if self.queued >= self.max_queued and not self._displace_below(priority):
            raise self._full()
        waiter = asyncio.get_running_loop().create_future()
        entry = _Waiter(priority, next(self._arrivals), waiter)
        bisect.insort(self._waiters, entry)
        try:
            # asyncio.timeout, not wait_for(shield(...)): no extra task per queued request.
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except (asyncio.TimeoutError, asyncio.CancelledError) as err:
            if waiter.done() and not waiter.cancelled():
                # release() handed us the slot just as we gave up: keep it on timeout,
                # give it back on cancellation.
                if isinstance(err, asyncio.CancelledError):
                    self.release()
                    raise
                return
            waiter.cancel()
            if isinstance(err, asyncio.CancelledError):
                raise
            raise Overloaded(
                f"waited {self.queue_timeout_s:g} s in the admission queue without a free slot "
                f"(queue_timeout_s={self.queue_timeout_s:g}, max_concurrent_requests={self.max_concurrent})",
                retry_after_s=self.retry_after_s()) from None
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def release(self) -> None:
        """Free a slot: hand it to the first waiter (lowest priority value, then oldest), or return it
        to the pool."""
        self._record_completion()
        while self._waiters:
            waiter = self._waiters.pop(0).future
            if not waiter.done():
                waiter.set_result(None)  # the slot passes over; in_flight is unchanged
                return
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def _full(self) -> Overloaded:
        return Overloaded(
            f"too many requests: {self.in_flight} in flight and {self.queued} queued "
            f"(max_concurrent_requests={self.max_concurrent}, max_queued_requests={self.max_queued})",
            retry_after_s=self.retry_after_s())

    def _displace_below(self, priority: int) -> bool:
        """Refuse the last live waiter if `priority` outranks it, freeing its place; whether one was."""
        for entry in reversed(self._waiters):
            if entry.future.done():
                continue
            if entry.priority <= priority:  # it ranks at least as high as the newcomer
                return False
            entry.future.set_exception(self._full())
            self._waiters.remove(entry)
            return True
        return False

    def retry_after_s(self) -> float:
        """Seconds until the requests queued now should have been served, from the recent completion rate."""
        now = self.clock()
        self._trim(now)
        if not self._completions:
            # Nothing finished lately: requests are long or stuck; do not invite a quick retry.
            return min(max(self.queue_timeout_s, 1.0), MAX_RETRY_AFTER_S)
        rate = len(self._completions) / max(now - self._completions[0], 1e-3)
        estimate = (self.queued + 1) / rate
        return min(max(estimate, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)

    def stop_admitting(self) -> None:
        """Refuse new requests (Unavailable); queued and in-flight ones continue."""
        self._admitting = False

    async def wait_idle(self) -> None:
        """Return once nothing is in flight or queued."""
        # Waiters exist only while slots are taken, so in_flight == 0 means idle.
        while self.in_flight:
            await self._idle.wait()

    def _take(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _record_completion(self) -> None:
        now = self.clock()
        self._completions.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        horizon = now - self.rate_window_s
        while self._completions and self._completions[0] < horizon:
            self._completions.popleft()


def retry_after_header(seconds: float) -> str:
    """The HTTP Retry-After value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))
