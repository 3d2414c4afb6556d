"""The cluster view's idle refresh, against real Redis: nobody reads it -> one Redis read per
`idle_refresh_s`; the next reader wakes the loop back to `refresh_s` at once."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from redis_support import REDIS_URL, delete_prefixed
from services.global_scheduler.view import ClusterViewSource
from splitserve.state.store import StateStore


@pytest.fixture
def prefix():
    unique = f"sstest:idleview:{uuid.uuid4().hex}:"
    yield unique
    asyncio.run(delete_prefixed(unique))


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)  # polling the view's state, bounded by the deadline


def test_an_unread_view_is_refreshed_rarely_and_a_reader_brings_the_rate_back(prefix):
    async def scenario() -> None:
        async with StateStore(REDIS_URL, prefix) as store:
            views = ClusterViewSource(store, refresh_s=0.01, idle_refresh_s=2.5, idle_after_s=0.2)
            await views.start()
            try:
                await _until(lambda: views.idle, 5.0, "the view never went idle")
                await _until(lambda: views.reads >= 2, 5.0, "no background refresh")
                idle_reads = views.reads
                await asyncio.sleep(0.5)  # a window to count reads in (measuring, not synchronising)
                assert views.reads - idle_reads <= 1  # idle: at most one read per 2.5 s, not ~50
                woke = views.reads
                await views.current()  # a reader: the loop wakes and refreshes at once
                assert not views.idle
                await _until(lambda: views.reads > woke, 1.0, "a reader did not wake the idle refresh")
                busy = views.reads
                for _ in range(25):  # read for ~0.5 s: the view is re-read every 10 ms again
                    await views.current()
                    await asyncio.sleep(0.02)
                assert views.reads - busy >= 5
            finally:
                await views.stop()
    asyncio.run(scenario())


def test_never_idle_by_default_and_the_idle_rate_must_beat_staleness():
    store = StateStore(REDIS_URL, "sstest:unused:")
    views = ClusterViewSource(store, refresh_s=0.05)
    views._used_monotonic -= 60  # long unread
    assert not views.idle  # idle_refresh_s 0: the rate never changes
    with pytest.raises(ValueError, match="idle_refresh_s"):
        ClusterViewSource(store, refresh_s=0.05, idle_refresh_s=3.0)  # within 2x of staleness (5 s)
