"""Admission (concurrency limit, FIFO queue, timeout, retry hints, drain) and the session table."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, Admission, retry_after_header
from splitserve.errors import Overloaded, Unavailable


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_admits_up_to_the_limit_then_queues():
    async def scenario():
        adm = Admission(2, 5, 10.0)
        await adm.acquire()
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await settle()
        assert (adm.in_flight, adm.queued, waiter.done()) == (2, 1, False)
        adm.release()
        await settle()
        assert waiter.done() and (adm.in_flight, adm.queued) == (2, 0)
        adm.release()
        adm.release()
        assert adm.in_flight == 0

    run(scenario())


def test_waiters_are_admitted_in_fifo_order():
    async def scenario():
        adm = Admission(1, 10, 10.0)
        await adm.acquire()
        order = []

        async def wait(i):
            await adm.acquire()
            order.append(i)

        tasks = [asyncio.create_task(wait(i)) for i in range(5)]
        await settle()
        for _ in range(5):
            adm.release()
            await settle()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]

    run(scenario())


def test_full_queue_is_overloaded_with_a_positive_hint_naming_the_limits():
    async def scenario():
        adm = Admission(1, 1, 10.0)
        await adm.acquire()
        queued = asyncio.create_task(adm.acquire())
        await settle()
        with pytest.raises(Overloaded) as info:
            await adm.acquire()
        assert info.value.retry_after_s > 0
        assert "max_queued_requests=1" in info.value.message and info.value.http_status == 429
        queued.cancel()

    run(scenario())


def test_zero_queue_rejects_as_soon_as_slots_are_taken():
    async def scenario():
        adm = Admission(1, 0, 10.0)
        await adm.acquire()
        with pytest.raises(Overloaded):
            await adm.acquire()

    run(scenario())


def test_queue_timeout_is_overloaded_and_leaves_the_queue():
    async def scenario():
        adm = Admission(1, 5, 0.05)
        await adm.acquire()
        with pytest.raises(Overloaded) as info:
            await adm.acquire()
        assert info.value.retry_after_s > 0 and "queue_timeout_s=0.05" in info.value.message
        assert (adm.queued, adm.in_flight) == (0, 1)
        adm.release()
        assert adm.in_flight == 0

    run(scenario())


def test_cancelled_waiter_gives_up_its_place_and_no_slot_leaks():
    async def scenario():
        adm = Admission(1, 5, 10.0)
        await adm.acquire()
        first = asyncio.create_task(adm.acquire())
        second = asyncio.create_task(adm.acquire())
        await settle()
        first.cancel()
        await settle()
        assert adm.queued == 1
        adm.release()
        await settle()
        assert second.done() and adm.in_flight == 1
        adm.release()
        assert adm.in_flight == 0

    run(scenario())


def test_slot_context_releases_on_error():
    async def scenario():
        adm = Admission(1, 0, 1.0)
        with pytest.raises(RuntimeError):
            async with adm.slot():
                assert adm.in_flight == 1
                raise RuntimeError("boom")
        assert adm.in_flight == 0

    run(scenario())


def test_retry_hint_follows_the_recent_completion_rate():
    async def scenario():
        clock = FakeClock()
        adm = Admission(1, 10, 30.0, clock=clock, rate_window_s=30.0)
        start = clock.now
        for i in range(10):  # 10 completions over 5 s: 2 per second
            clock.now = start + 0.5 * i
            await adm.acquire()
            adm.release()
        clock.now = start + 5.0
        assert adm.retry_after_s() == pytest.approx(0.5)  # nothing queued: one completion away
        await adm.acquire()
        waiters = [asyncio.create_task(adm.acquire()) for _ in range(3)]
        await settle()
        assert adm.retry_after_s() == pytest.approx(2.0)  # 3 queued + this one, at 2/s
        clock.now = start + 100.0  # the window forgot them: fall back to the queue timeout
        assert adm.retry_after_s() == 30.0
        for w in waiters:
            w.cancel()

    run(scenario())


def test_retry_hint_is_clamped():
    clock = FakeClock()
    adm = Admission(1, 10, 600.0, clock=clock)
    assert adm.retry_after_s() == MAX_RETRY_AFTER_S
    for _ in range(1000):
        adm.in_flight = 1
        adm.release()
    clock.now += 1.0
    assert adm.retry_after_s() == MIN_RETRY_AFTER_S


def test_retry_after_header_rounds_up_to_whole_seconds():
    assert [retry_after_header(s) for s in (0.01, 1.0, 1.2, 59.9)] == ["1", "1", "2", "60"]


def test_drain_refuses_new_requests_and_waits_for_in_flight():
    async def scenario():
        adm = Admission(2, 2, 10.0)
        await adm.acquire()
        adm.stop_admitting()
        with pytest.raises(Unavailable):
            await adm.acquire()
        idle = asyncio.create_task(adm.wait_idle())
        await settle()
        assert not idle.done()
        adm.release()
        await asyncio.wait_for(idle, 1.0)

    run(scenario())


def test_invalid_limits():
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        Admission(0, 1, 1.0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        Admission(1, -1, 1.0)


def test_waiters_are_admitted_by_priority_then_arrival():
    """Lower priority value first (vLLM's --scheduling-policy priority), FIFO among equals."""
    async def scenario():
        adm = Admission(1, 10, 10.0)
        await adm.acquire()
        order = []

        async def wait(name, priority):
            await adm.acquire(priority)
            order.append(name)

        tasks = []
        for name, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)]:
            tasks.append(asyncio.create_task(wait(name, priority)))
            await settle()
        for _ in tasks:
            adm.release()
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["c", "e", "a", "d", "b"]

    run(scenario())


def test_a_full_queue_refuses_its_lowest_ranked_waiter_for_a_request_that_outranks_it():
    async def scenario():
        adm = Admission(1, 2, 10.0)
        await adm.acquire()
        low = asyncio.create_task(adm.acquire(3))
        mid = asyncio.create_task(adm.acquire(1))
        await settle()
        urgent = asyncio.create_task(adm.acquire(0))
        await settle()
        assert low.done() and isinstance(low.exception(), Overloaded)
        assert low.exception().retry_after_s > 0
        assert adm.queued == 2 and not mid.done() and not urgent.done()
        # A newcomer that does not outrank the last waiter is refused itself.
        with pytest.raises(Overloaded):
            await adm.acquire(1)
        adm.release()
        await settle()
        assert urgent.done() and not mid.done()
        adm.release()
        await settle()
        assert mid.done()

    run(scenario())
