"""Sessions in Redis (AMPD binding): the atomic scripts behind SessionService, on a real Redis.

Open/refresh/limit per owner, one round in flight at a time (and a stale one released at
its busy_until), where the history lives after a round, close by owner, and expiry.
"""

from __future__ import annotations

import asyncio

import pytest
from test_state import T0, open_store, prefix, run, wait_until  # noqa: F401  (prefix is a fixture)

from services.coordinator.sessions import SessionLimits, SessionService
from splitserve.errors import Conflict, InvalidArgument, NotFound, Overloaded


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_open_round_end_close(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            clock = Clock()
            sessions = SessionService(store, SessionLimits(default_ttl_s=30, max_ttl_s=300), clock)
            sid, ttl = await sessions.open(owner="alice")
            assert len(sid) == 32 and ttl == 30
            record = await sessions.begin_round(sid, "r1", prompt_len=100)
            assert record.decode_worker == "" and record.history_len == 0 and record.busy == "r1"
            with pytest.raises(Conflict, match="round in flight .*r1"):
                await sessions.begin_round(sid, "r2", prompt_len=120)
            assert await sessions.end_round(record, "r1", "w-2", 130)
            record = await sessions.begin_round(sid, "r2", prompt_len=150)
            assert (record.decode_worker, record.history_len, record.owner) == ("w-2", 130, "alice")
            assert not await sessions.end_round(record, "someone-else", "w-9", 1)  # not its round
            assert await sessions.end_round(record, "r2", None, None)  # a failed round keeps the binding
            assert (await store.get_session(sid)).decode_worker == "w-2"
            assert await sessions.close(sid, owner="bob") is None  # another key's session: not found
            closed = await sessions.close(sid, owner="alice")
            assert closed is not None and closed.decode_worker == "w-2"
            with pytest.raises(NotFound, match="does not exist"):
                await sessions.begin_round(sid, "r3", prompt_len=10)
            assert await sessions.close(sid, owner="alice") is None

    run(scenario())


def test_limits_name_themselves(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            clock = Clock()
            limits = SessionLimits(default_ttl_s=30, max_ttl_s=300, max_sessions_per_owner=2, max_history_tokens=500)
            sessions = SessionService(store, limits, clock)
            await sessions.open("a", owner="k1")
            await sessions.open("b", owner="k1")
            assert await sessions.open("a", ttl_s=60, owner="k1") == ("a", 60)  # refresh, not a third
            with pytest.raises(Overloaded, match="max_sessions_per_key 2"):
                await sessions.open("c", owner="k1")
            await sessions.open("c", owner="k2")  # another key has its own count
            with pytest.raises(Conflict, match="already in use"):
                await sessions.open("c", owner="k1")
            with pytest.raises(InvalidArgument, match="max_session_ttl_s") as err:
                await sessions.open("d", ttl_s=301, owner="k2")
            assert err.value.param == "ttl_s"
            with pytest.raises(InvalidArgument, match="max_session_history_tokens"):
                await sessions.begin_round("a", "r1", prompt_len=501)
            with pytest.raises(InvalidArgument, match="session_id must be"):
                await sessions.open("has space", owner="k1")
            # A closed session frees its place at once; an expired one when its TTL passes.
            await sessions.close("b", owner="k1")
            await sessions.open("e", owner="k1")
            clock.now += 61  # "a" (60 s) and "e" (30 s) are past their TTL in the owner's set
            await sessions.open("f", owner="k1")

    run(scenario())


def test_a_crashed_round_stops_blocking_at_busy_until(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            clock = Clock()
            sessions = SessionService(store, SessionLimits(round_timeout_s=5.0), clock)
            sid, _ = await sessions.open(owner="")
            await sessions.begin_round(sid, "lost", prompt_len=10)  # its coordinator dies
            with pytest.raises(Conflict):
                await sessions.begin_round(sid, "next", prompt_len=10)
            clock.now += 6
            assert (await sessions.begin_round(sid, "next", prompt_len=10)).busy == "next"

    run(scenario())


def test_idle_session_expires(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            sessions = SessionService(store, SessionLimits(default_ttl_s=0.3, max_ttl_s=10))
            sid, _ = await sessions.open(owner="")

            async def gone() -> bool:
                return await store.get_session(sid) is None

            await wait_until(gone, "the idle session to expire")
            with pytest.raises(NotFound):
                await sessions.begin_round(sid, "r", prompt_len=5)

    run(scenario())


def test_concurrent_rounds_admit_exactly_one(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            sessions = SessionService(store)
            sid, _ = await sessions.open(owner="")
            results = await asyncio.gather(*(sessions.begin_round(sid, f"r{i}", 10) for i in range(16)),
                                           return_exceptions=True)
            assert sum(not isinstance(r, Exception) for r in results) == 1
            assert all(isinstance(r, Conflict) for r in results if isinstance(r, Exception))

    run(scenario())
