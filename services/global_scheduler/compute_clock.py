"""A worker's committed compute: DynaServe's per-server execution clock (Alg. 1, §4.1).

Algorithm 1 balances T1 and T2, "the predicted time for each server to complete all assigned
micro-requests" (the paper's `prefill_clk` / `decode_clk`). A first version compared the
pass-space timelines' *drain times* instead, and that cannot balance anything (measured in
docs/benchmarks.md, "DynaServe evaluation"): with continuous batching a worker's drain time
is its longest remaining decode, not its load (one 512-token decode drains as late as
eighty), and the request's own second stage cannot start before the first ends, so T2 > T1
for every split below φ = 1 and the search never gave the second worker any prefill.

So the balance is taken over *work*: each micro-request adds the seconds of device work the
performance model says it costs (`PerfModel.work_seconds`: with measured GPU tables each
kernel class's share, decode attention included, since kernels add on a GPU; on the
datasheet roofline the compute line, under which memory-bound decode passes cost little),
and a worker's clock is what of its committed work is not done yet, assuming each
micro-request runs at a steady pace between its predicted first pass and its finish (the
timeline predicts both).

Cost: `add`/`remove` O(log n), `backlog(now)` amortised O(log n) (two heaps of start and
finish times with lazy deletion; the linear decay kept as two running sums).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

@dataclass(slots=True)
class _Work:
    seconds: float
    start: float
    finish: float
    state: int = 0  # 0 queued (counts in full), 1 running (decays), 2 gone


class ComputeClock:
    """Compute seconds committed to one worker and not yet done at a given time."""

    def __init__(self) -> None:
        self._work: dict[str, _Work] = {}
        self._starts: list[tuple[float, str]] = []
        self._finishes: list[tuple[float, str]] = []
        self._queued = 0.0  # sum of seconds of work not started
        # Running work decays linearly: remaining = seconds * (finish - now) / (finish - start),
        # so the sum is a - now * b with a = sum seconds*finish/span, b = sum seconds/span.
        self._a = 0.0
        self._b = 0.0
        self._running = 0
        self._now = float("-inf")
        # Times are kept relative to the first one seen, so that a - now * b does not cancel
        # digits of an epoch-sized clock.
        self._origin: float | None = None

    def __len__(self) -> int:
        return len(self._work)

    def add(self, key: str, seconds: float, start: float, finish: float) -> None:
        """Commit `seconds` of compute that runs from `start` to `finish` (scheduler clock)."""
        self.remove(key)
        if self._origin is None:
            self._origin = start
        start, finish = start - self._origin, max(finish, start) - self._origin
        work = _Work(max(0.0, seconds), start, finish)
        self._work[key] = work
        if start > self._now:
            self._queued += work.seconds
            heapq.heappush(self._starts, (start, key))
        else:
            self._start(work)
            if finish > self._now:
                heapq.heappush(self._finishes, (finish, key))
            else:
                self._stop(key, work)

    def remove(self, key: str) -> None:
        """Take a micro-request out (it ended, early or on time); unknown keys are ignored."""
        work = self._work.pop(key, None)
        if work is None:
            return
        if work.state == 0:
            self._queued -= work.seconds
        elif work.state == 1:
            self._drop_running(work)
        work.state = 2  # its heap entries are skipped when they come up

    def reset(self) -> None:
        """Nothing is committed any more (the worker reported itself idle)."""
        self.__init__()

    def backlog(self, now: float) -> float:
        """Compute seconds committed and not done by `now` (time only moves forward here)."""
        if self._origin is None:
            return 0.0
        now -= self._origin
        if now > self._now:
            self._now = now
            while self._starts and self._starts[0][0] <= now:
                _, key = heapq.heappop(self._starts)
                work = self._work.get(key)
                if work is not None and work.state == 0 and work.start <= now:
                    self._queued -= work.seconds
                    self._start(work)
                    heapq.heappush(self._finishes, (work.finish, key))
            while self._finishes and self._finishes[0][0] <= now:
                _, key = heapq.heappop(self._finishes)
                work = self._work.get(key)
                if work is not None and work.state == 1 and work.finish <= now:
                    self._stop(key, work)
        running = self._a - self._now * self._b
        return max(0.0, self._queued + running)

    # ---- internals -----------------------------------------------------------------------
    def _start(self, work: _Work) -> None:
        work.state = 1
        self._running += 1
        span = work.finish - work.start
        if span > 0:
            self._a += work.seconds * work.finish / span
            self._b += work.seconds / span

    def _drop_running(self, work: _Work) -> None:
        span = work.finish - work.start
        if span > 0:
            self._a -= work.seconds * work.finish / span
            self._b -= work.seconds / span
        self._running -= 1
        if self._running == 0:
            self._a = self._b = 0.0  # no rounding residue once nothing runs

    def _stop(self, key: str, work: _Work) -> None:
        self._drop_running(work)
        work.state = 2
        self._work.pop(key, None)
