"""The one thread that calls a NIXL agent: submitted calls in order, notification polls in between.

The agent is not thread-safe in its default sync mode, and with UCX's CMA transport a
post copies the bytes before it returns, so the event loop never calls NIXL itself.
Polling for notifications inside this thread (rather than as an event-loop task that
hops to an executor every millisecond) costs one Python call per poll and wakes the
event loop only when something arrived; the `PollSchedule` decides how often to poll.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from workers.kv_transfer.poll_schedule import PollSchedule

log = logging.getLogger(__name__)

_STOP = object()


class NixlThread:
    """Runs `submit`ted calls one at a time; when idle, calls `poll` as often as `schedule` says."""

    def __init__(self, name: str, poll: Callable[[], bool], schedule: PollSchedule):
        self._poll = poll  # returns whether it found anything
        self._schedule = schedule
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._polling = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) on the thread, after the calls submitted before it."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the thread without waiting for it (errors are logged).

        Changes to the schedule go through here: only this thread touches it, and a
        transfer announced while the poller idles is polled for at once, not after the
        idle delay.
        """
        self._jobs.put((None, fn, args))

    def start_polling(self) -> None:
        """Begin polling (once the agent exists)."""
        self.call_soon(self._enable_polling)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the calls already submitted, then end the thread."""
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)

    def _enable_polling(self) -> None:
        self._polling = True

    def _run(self) -> None:
        while True:
            wait_s = self._schedule.seconds_until_poll() if self._polling else None
            try:
                job = self._jobs.get(timeout=wait_s) if wait_s != 0 else self._jobs.get_nowait()
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            if job is not None:
                self._run_job(*job)
            if self._polling and self._schedule.seconds_until_poll() == 0:
                try:
                    found = self._poll()
                except Exception:
                    log.exception("polling NIXL notifications failed")
                    found = False
                self._schedule.polled(found)

    @staticmethod
    def _run_job(future: Future | None, fn: Callable[..., Any], args: tuple) -> None:
        if future is None:
            try:
                fn(*args)
            except Exception:
                log.exception("NIXL thread call %s failed", getattr(fn, "__name__", fn))
            return
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever awaits the call
            future.set_exception(exc)
