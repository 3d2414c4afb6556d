"""NixlThread: calls run in order on one thread; notification polls happen between them, on schedule."""

from __future__ import annotations

import threading

import pytest

from workers.kv_transfer.nixl_thread import NixlThread
from workers.kv_transfer.poll_schedule import PollSchedule

TIMEOUT_S = 10.0


class CountingPoll:
    """A poll function that reports on which thread it ran and signals after `target` polls."""

    def __init__(self, target: int):
        self.calls = 0
        self.threads: set[str] = set()
        self.target = target
        self.reached = threading.Event()

    def __call__(self) -> bool:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls >= self.target:
            self.reached.set()
        return False


def test_calls_run_in_order_on_the_thread_and_errors_reach_the_caller():
    thread = NixlThread("nixl-test", CountingPoll(1), PollSchedule())
    try:
        seen: list[tuple[int, str]] = []
        futures = [thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
                   for i in range(20)]
        assert [f.result(TIMEOUT_S) for f in futures] == list(range(20))
        assert seen == [(i, "nixl-test") for i in range(20)]
        failing = thread.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(TIMEOUT_S)
    finally:
        thread.stop()


def test_no_polling_until_started_then_polls_on_the_thread():
    poll = CountingPoll(target=3)
    thread = NixlThread("nixl-poll", poll, PollSchedule(fast_s=0.001, idle_s=0.002))
    try:
        thread.submit(lambda: None).result(TIMEOUT_S)
        assert poll.calls == 0
        thread.start_polling()
        assert poll.reached.wait(TIMEOUT_S)
        assert poll.threads == {"nixl-poll"}
    finally:
        thread.stop()


def test_an_expectation_wakes_an_idle_poller_at_once():
    poll = CountingPoll(target=10**9)
    # An idle delay far beyond the test timeout: only the expectation can cause more polls.
    schedule = PollSchedule(fast_s=0.001, idle_s=3600.0)
    thread = NixlThread("nixl-wake", poll, schedule)
    try:
        thread.start_polling()
        poll.target = 1
        assert poll.reached.wait(TIMEOUT_S)
        before = poll.calls
        for _ in range(30):  # idle polls, reported on the thread: the next poll is an hour away
            thread.submit(schedule.polled, False).result(TIMEOUT_S)
        assert thread.submit(schedule.seconds_until_poll).result(TIMEOUT_S) > 60
        poll.reached.clear()
        poll.target = poll.calls + 5
        thread.call_soon(schedule.expect, "t1", 30.0)
        assert poll.reached.wait(TIMEOUT_S), "an expected transfer must bring fast polling back"
        assert poll.calls - before >= 5
    finally:
        thread.stop()
