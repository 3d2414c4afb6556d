"""When a NIXL worker should next look for notifications. Pure: the clock is injected.

A NIXL notification (a pushed chunk has landed) only surfaces when someone polls the
agent, and every poll costs CPU. So: poll fast while a transfer into this worker is
expected (PrepareKv reserved blocks for it) or a notification just arrived (more
chunks usually follow), and otherwise back off exponentially to `idle_s`. Expecting a
transfer snaps straight back to fast polling. Every expectation has a deadline, so a
transfer that never comes cannot keep the poller fast forever.
"""

from __future__ import annotations

import time
from typing import Callable


class PollSchedule:
    """Delay before the next notification poll: `fast_s` while busy, growing ×2 up to `idle_s` while idle."""

    def __init__(self, fast_s: float = 0.001, idle_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        if not 0 < fast_s <= idle_s:
            raise ValueError(f"need 0 < fast_s <= idle_s, got {fast_s}, {idle_s}")
        self.fast_s = fast_s
        self.idle_s = idle_s
        self._clock = clock
        self._expected: dict[str, float] = {}  # key -> deadline
        self._delay = fast_s
        self._next_at = clock()

    def expect(self, key: str, timeout_s: float) -> None:
        """A transfer `key` is on its way (for at most timeout_s): poll fast, starting now."""
        self._expected[key] = self._clock() + max(0.0, timeout_s)
        self._delay = self.fast_s
        self._next_at = self._clock()

    def done(self, key: str) -> None:
        """Transfer `key` arrived or was given up; polling slows down once nothing else is expected."""
        self._expected.pop(key, None)

    @property
    def expecting(self) -> int:
        """How many transfers are still expected (expired ones dropped)."""
        self._drop_expired()
        return len(self._expected)

    def seconds_until_poll(self) -> float:
        """How long the poller may wait before its next poll (0 if one is due)."""
        return max(0.0, self._next_at - self._clock())

    def polled(self, found_notifications: bool) -> float:
        """Record a poll and what it found; returns the delay until the next one."""
        if found_notifications or self.expecting:
            self._delay = self.fast_s
        else:
            self._delay = min(self.idle_s, self._delay * 2)
        self._next_at = self._clock() + self._delay
        return self._delay

    def _drop_expired(self) -> None:
        now = self._clock()
        for key in [k for k, deadline in self._expected.items() if deadline <= now]:
            del self._expected[key]
