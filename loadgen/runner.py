"""Drive a target with a workload: open-loop arrivals, closed-loop concurrency, multi-round sessions.

* Open loop (default): item ``i`` is sent at ``t0 + offsets[i]``, each sleep computed
  from the absolute start so lateness never accumulates; ``max_concurrency`` caps the
  requests in flight (later arrivals wait for a slot, as in vLLM's benchmark, and their
  TTFT is measured from the actual send).
* Closed loop (``concurrency=N``): N workers each send their next item as soon as
  their previous one finished; arrivals are ignored.
* Sessions: items are :class:`~loadgen.plan.SessionPlan`; the arrival offsets (or the
  closed-loop workers) start sessions, and each round is sent after the previous
  round's last token plus its tool delay, carrying the whole history.
* Bounds: a run ends when every item is done, or at ``duration_limit_s``: nothing is
  sent after it, and requests still streaming are cut off and recorded as failed with
  the error :data:`CUT_OFF`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import numpy as np

from loadgen.arrivals import ArrivalProcess
from loadgen.metrics import RequestResult
from loadgen.plan import BenchRequest, SessionPlan, StreamedResult, Target

__all__ = ["CUT_OFF", "RunProgress", "run_benchmark", "arrival_offsets", "session_round_request"]

CUT_OFF = "cut off at duration limit"

WorkItem = Union[BenchRequest, SessionPlan]


@dataclass
class RunProgress:
    """Live counters of a run, updated in place and handed to the progress callback."""

    total: int
    sent: int = 0
    done: int = 0
    errors: int = 0
    output_tokens: int = 0
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet finished."""
        return self.sent - self.done

    @property
    def elapsed_s(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started_at

    @property
    def output_throughput(self) -> float:
        """Output tokens per second so far."""
        elapsed = self.elapsed_s
        return self.output_tokens / elapsed if elapsed > 0 else 0.0


ProgressCallback = Callable[[RunProgress], None]


def arrival_offsets(arrival: ArrivalProcess | Sequence[float] | None, n: int,
                    rng: np.random.Generator | None = None) -> np.ndarray:
    """Send offsets for ``n`` items: from a process, given explicitly, or all at 0 when None."""
    if arrival is None:
        return np.zeros(n)
    if isinstance(arrival, ArrivalProcess):
        return arrival.offsets(n, rng if rng is not None else np.random.default_rng(0))
    offsets = np.asarray(arrival, dtype=np.float64)
    if offsets.shape != (n,):
        raise ValueError(f"arrival: {offsets.size} offsets given for {n} items")
    if np.any(np.diff(offsets) < 0):
        raise ValueError("arrival: offsets must be non-decreasing")
    return offsets


def session_round_request(plan: SessionPlan, round_index: int, history: Sequence[int]) -> BenchRequest:
    """The request of one session round: the history so far followed by the round's new tokens."""
    planned = plan.rounds[round_index]
    return BenchRequest(
        request_id=f"{plan.session_id}/r{round_index}",
        prompt_token_ids=[*history, *planned.incr_prompt_ids],
        output_len=planned.output_len,
        session_id=plan.session_id,
        round_index=round_index,
    )


def _output_ids_for_history(result: RequestResult, filler: list[int]) -> list[int]:
    """The round's real output ids when the target reported them all, else filler of the same length."""
    ids = getattr(result, "output_token_ids", None) or []
    if len(ids) == result.output_len:
        return list(ids)
    count = result.output_len
    # Repeat the filler in the rare case the server produced more tokens than asked.
    return (filler * (count // max(1, len(filler)) + 1))[:count] if filler else []


class _Run:
    """One benchmark run's shared state: target, clock, limits, counters and results."""

    def __init__(self, target: Target, total: int, max_concurrency: int | None,
                 duration_limit_s: float | None, progress: ProgressCallback | None):
        self.target = target
        self.t0 = time.perf_counter()
        target.origin_s = self.t0
        self.deadline = None if duration_limit_s is None else self.t0 + duration_limit_s
        self.slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.state = RunProgress(total=total, started_at=self.t0)
        self.progress = progress
        self.results: list[RequestResult] = []
        self.cutting_off = False

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def expired(self) -> bool:
        """True once nothing more may be sent: the duration limit passed or the run is being cut off."""
        return self.cutting_off or (self.deadline is not None and time.perf_counter() >= self.deadline)

    def report(self) -> None:
        if self.progress is not None:
            self.progress(self.state)

    async def sleep_until(self, offset_s: float) -> None:
        # Sleep to an absolute time, so per-send lateness never accumulates into drift.
        delay = self.t0 + offset_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def send(self, request: BenchRequest) -> RequestResult | None:
        """Send one request within the concurrency cap; None when the run ended before it went out."""
        if self.slots is None:
            return await self._send_now(request)
        async with self.slots:
            return await self._send_now(request)

    async def _send_now(self, request: BenchRequest) -> RequestResult | None:
        if self.expired():
            return None
        self.state.sent += 1
        self.report()
        sent_at = self.now()
        try:
            result = await self.target.send(request)
        except asyncio.CancelledError:
            result = self._failed(request, sent_at, CUT_OFF)
        except Exception as err:  # noqa: BLE001 -- a misbehaving target must not end the run
            result = self._failed(request, sent_at, f"{type(err).__name__}: {err}")
        if self.cutting_off and not result.ok:
            result.error = CUT_OFF
        self.results.append(result)
        self.state.done += 1
        self.state.errors += 0 if result.ok else 1
        self.state.output_tokens += result.output_len if result.ok else 0
        self.report()
        return result

    def _failed(self, request: BenchRequest, sent_at: float, error: str) -> StreamedResult:
        return StreamedResult(request.request_id, request.session_id, request.round_index, sent_at, None, [],
                              self.now(), request.prompt_len, 0, False, error)

    async def run_item(self, item: WorkItem) -> None:
        if isinstance(item, BenchRequest):
            await self.send(item)
            return
        history: list[int] = []
        # A target with a session API (splitserve) opens the session first, so that the
        # server keeps its history between rounds, and closes it after the last round.
        opener, closer = getattr(self.target, "open_session", None), getattr(self.target, "close_session", None)
        if opener is not None and not self.expired():
            try:
                await opener(item.session_id)
            except Exception as err:  # noqa: BLE001 -- the first round is reported as failed
                request = session_round_request(item, 0, history)
                self.results.append(self._failed(request, self.now(), f"open session: {type(err).__name__}: {err}"))
                self.state.done += 1
                self.state.errors += 1
                self.report()
                return
        try:
            for index, planned in enumerate(item.rounds):
                if self.expired():
                    return
                if index > 0 and planned.delay_before_s > 0:
                    await asyncio.sleep(planned.delay_before_s)  # the tool call between rounds
                request = session_round_request(item, index, history)
                result = await self.send(request)
                if result is None or not result.ok:
                    return  # a failed round ends its session: later rounds have no history to build on
                history = [*request.prompt_token_ids, *_output_ids_for_history(result, planned.filler_output_ids)]
        finally:
            if opener is not None and closer is not None:
                await closer(item.session_id)


async def run_benchmark(
    target: Target,
    requests: Sequence[WorkItem],
    arrival: ArrivalProcess | Sequence[float] | None = None,
    max_concurrency: int | None = None,
    duration_limit_s: float | None = None,
    progress: ProgressCallback | None = None,
    *,
    concurrency: int | None = None,
    rng: np.random.Generator | None = None,
) -> list[RequestResult]:
    """Run the workload against ``target`` and return one result per request sent, by arrival."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    if duration_limit_s is not None and not duration_limit_s > 0:
        raise ValueError(f"duration_limit_s: must be > 0, got {duration_limit_s}")
    items = list(requests)
    total = sum(len(i.rounds) if isinstance(i, SessionPlan) else 1 for i in items)
    offsets = None if concurrency else arrival_offsets(arrival, len(items), rng)
    run = _Run(target, total, max_concurrency, duration_limit_s, progress)
    run.report()

    tasks: list[asyncio.Task] = []
    if concurrency:
        queue = deque(items)

        async def worker() -> None:
            while queue and not run.expired():
                await run.run_item(queue.popleft())

        tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(items)) or 1)]
    else:

        async def dispatch() -> None:
            for offset, item in zip(offsets, items):
                await run.sleep_until(float(offset))
                if run.expired():
                    return
                tasks.append(asyncio.create_task(run.run_item(item)))

        tasks.append(asyncio.create_task(dispatch()))

    try:
        await _wait_all(tasks, run.deadline)
    finally:
        pending = [t for t in tasks if not t.done()]
        if pending:
            run.cutting_off = True
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # a bug in the runner itself, not a serving error
    return sorted(run.results, key=lambda r: (r.arrival_s, r.request_id))


async def _wait_all(tasks: list[asyncio.Task], deadline: float | None) -> None:
    """Wait for every task, including ones created while waiting, or until ``deadline``."""
    while True:
        pending = [t for t in tasks if not t.done()]
        if not pending:
            return
        timeout = None if deadline is None else deadline - time.perf_counter()
        if timeout is not None and timeout <= 0:
            return
        await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
