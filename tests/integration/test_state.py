"""splitserve.state.store against a real Redis (SPLITSERVE_TEST_REDIS_URL, default local).

Every test gets its own key prefix and deletes its keys afterwards. An unreachable
Redis fails the tests with a message saying so; they never skip. pytest-asyncio is not
a dependency: each test is a sync function running one coroutine with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from redis_support import REDIS_URL, delete_prefixed
from splitserve.state.store import (
    LatencyWindow,
    PrefillTask,
    RedisRetryPolicy,
    RequestRecord,
    SessionRecord,
    StateStore,
    StateUnavailableError,
    WorkerInfo,
    WorkerLoad,
)

FAST_RETRY = RedisRetryPolicy(attempts=2, base_delay_s=0.05, max_delay_s=0.2, socket_timeout_s=2.0)
T0 = 1_700_000_000.0  # injected clock origin for tests that control `now`

_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run one coroutine to completion in a fresh event loop."""
    return asyncio.run(coro)


@pytest.fixture
def prefix() -> Any:
    """A key prefix no other test uses; its keys are deleted afterwards."""
    unique = f"sstest:{uuid.uuid4().hex}:"
    yield unique
    with contextlib.suppress(RedisConnectionError, OSError):  # nothing to clean up then
        run(delete_prefixed(unique))


@contextlib.asynccontextmanager
async def open_store(prefix: str, **options: Any) -> AsyncIterator[StateStore]:
    """A connected store; an unreachable Redis fails the test with a clear message."""
    options.setdefault("retry_policy", FAST_RETRY)
    store = StateStore(REDIS_URL, prefix=prefix, **options)
    unavailable: StateUnavailableError | None = None
    try:
        await store.connect()
    except StateUnavailableError as exc:
        unavailable = exc
    if unavailable is not None:  # failed outside the except block: one clean message
        await store.close()
        pytest.fail(
            f"these integration tests need a real Redis at {REDIS_URL} "
            f"(start redis-server or set SPLITSERVE_TEST_REDIS_URL): {unavailable}",
            pytrace=False,
        )
    try:
        yield store
    finally:
        await store.close()


async def wait_until(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 5.0
) -> None:
    """Poll condition until it holds; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def worker(worker_id: str, role: str = "both") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        address=f"127.0.0.1:{50000 + int(worker_id.rsplit('-', 1)[1])}",
        role=role,
        engine_kind="emulated",
        model="demo-llama",
        started_unix=T0,
    )


# ---- worker registry and loads -------------------------------------------------------


def test_worker_disappears_when_heartbeats_stop(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            await store.register_worker(worker("w-1"), ttl_s=0.3)
            await store.register_worker(worker("w-2", role="decode"), ttl_s=30.0)
            assert await store.list_workers() == [worker("w-1"), worker("w-2", role="decode")]
            assert await store.heartbeat("w-1", ttl_s=0.3)

            async def w1_gone() -> bool:
                return [w.worker_id for w in await store.list_workers()] == ["w-2"]

            await wait_until(w1_gone, "w-1's registration to expire")
            assert not await store.heartbeat("w-1", ttl_s=0.3)  # must re-register
            await store.register_worker(worker("w-1"), ttl_s=30.0)
            assert [w.worker_id for w in await store.list_workers()] == ["w-1", "w-2"]

    run(scenario())


def test_heartbeat_extends_registration(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            await store.register_worker(worker("w-1"), ttl_s=0.3)
            assert await store.heartbeat("w-1", ttl_s=30.0)
            pttl_ms = await store._redis.pttl(store._keys.worker("w-1"))
            assert 1_000 < pttl_ms <= 30_000

    run(scenario())


def test_deregister_removes_worker_and_what_it_published(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            await store.register_worker(worker("w-1"))
            await store.publish_load(WorkerLoad(worker_id="w-1", free_blocks=5))
            await store.record_ttft("w-1", 0.1)
            await store.publish_prefill_queue("w-1", [PrefillTask("t", 0, 10, T0)])
            await store.put_nixl_metadata("w-1", b"agent")
            assert await store.deregister_worker("w-1")
            assert await store.list_workers() == []
            assert await store.get_loads() == {}
            assert (await store.window_stats("w-1", "ttft")).count == 0
            assert await store.get_prefill_queue("w-1") == []
            assert await store.get_nixl_metadata("w-1") is None
            assert not await store.deregister_worker("w-1")

    run(scenario())


def test_load_snapshot_round_trips_with_ttl(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix, heartbeat_ttl_s=3.0) as store:
            await store.register_worker(worker("w-1"))
            await store.register_worker(worker("w-2"))
            load = WorkerLoad(
                worker_id="w-1",
                role="prefill",
                engine_kind="llama",
                free_blocks=120,
                total_blocks=512,
                block_size=16,
                running=3,
                waiting=7,
                queued_prefill_tokens=4096,
                draining=True,
                updated_unix=T0 + 0.125,
            )
            await store.publish_load(load)
            assert await store.get_loads() == {"w-1": load}  # w-2 published nothing
            pttl_ms = await store._redis.pttl(store._keys.worker_load("w-1"))
            assert 3_000 < pttl_ms <= 6_000  # twice the heartbeat TTL

    run(scenario())


# ---- windowed latency samples --------------------------------------------------------


def test_window_trims_old_samples_and_uses_nearest_rank_percentiles(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix, latency_window_s=10.0) as store:
            await store.record_ttft("w-1", 100.0, now=T0 - 30.0)
            await store.record_ttft("w-1", 50.0, now=T0 - 10.5)
            values = [7.0, 3.0, 10.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0]
            for i, value in enumerate(values):  # recorded at T0-9 .. T0
                await store.record_ttft("w-1", value, now=T0 - 9.0 + i)

            # A huge read window sees everything still stored: the old samples were
            # removed from Redis by the recording script, not just filtered on read.
            stored = await store.window_stats("w-1", "ttft", now=T0, window_s=1e9)
            assert stored.count == 10
            # Sorted 1..10: p50 is the 5th, p90 the 9th, p99 the 10th sample.
            assert await store.window_stats("w-1", "ttft", now=T0) == LatencyWindow(
                count=10, mean=5.5, p50=5.0, p90=9.0, p99=10.0, max=10.0
            )
            # Last 4.5 s: samples at T0-4 .. T0 are 9, 2, 8, 4, 6 -> sorted 2, 4, 6, 8, 9.
            recent = await store.window_stats("w-1", "ttft", now=T0, window_s=4.5)
            assert recent == LatencyWindow(count=5, mean=5.8, p50=6.0, p90=9.0, p99=9.0, max=9.0)
            assert (await store.window_stats("w-1", "itl", now=T0)).count == 0

    run(scenario())


def test_equal_values_at_the_same_time_are_separate_samples(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            for _ in range(5):
                await store.record_itl("w-1", 0.02, now=T0)
            window = await store.window_stats("w-1", "itl", now=T0)
            assert window.count == 5
            assert window.mean == pytest.approx(0.02)

    run(scenario())


def test_sample_count_is_capped_keeping_the_newest(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix, max_latency_samples=4) as store:
            for i in range(8):
                kept = await store.record_itl("w-1", float(i), now=T0 + i * 0.01)
            assert kept == 4
            window = await store.window_stats("w-1", "itl", now=T0 + 1.0)
            assert (window.count, window.p50, window.max) == (4, 5.0, 7.0)

    run(scenario())


def test_concurrent_recorders_lose_no_samples(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as first, open_store(prefix) as second:
            records = [
                (first if i % 2 else second).record_ttft("w-1", 0.5, now=T0 + i / 1000)
                for i in range(200)
            ]
            await asyncio.gather(*records)
            window = await first.window_stats("w-1", "ttft", now=T0 + 1.0)
            assert window.count == 200
            assert window.max == 0.5

    run(scenario())


# ---- prefill queue, sessions, requests -----------------------------------------------


def test_prefill_queue_is_replaced_not_appended(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            first = [PrefillTask(f"t{i}", 100 * i, 32 + i, T0 + i) for i in range(3)]
            await store.publish_prefill_queue("w-1", first)
            assert await store.get_prefill_queue("w-1") == first
            second = [PrefillTask("t9", 2048, 64, T0 + 9.5)]
            await store.publish_prefill_queue("w-1", second)
            assert await store.get_prefill_queue("w-1") == second
            await store.publish_prefill_queue("w-1", [])
            assert await store.get_prefill_queue("w-1") == []

    run(scenario())


def test_session_record_round_trips_and_expires(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            session = SessionRecord("s-1", decode_worker="w-3", history_len=812, last_use=T0)
            await store.put_session(session, ttl_s=30.0)
            assert await store.get_session("s-1") == session
            assert 0 < await store._redis.pttl(store._keys.session("s-1")) <= 30_000
            assert await store.delete_session("s-1")
            assert await store.get_session("s-1") is None

            await store.put_session(session, ttl_s=0.3)

            async def gone() -> bool:
                return await store.get_session("s-1") is None

            await wait_until(gone, "the session record to expire")

    run(scenario())


def test_request_record_appends_emitted_tokens_atomically(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            stages = [
                {"worker_id": "w-1", "start": 0, "end": 5},
                {"worker_id": "w-2", "start": 5, "end": 13},
            ]
            request = RequestRecord("r-1", "running", stages, [11, 12], updated=T0)
            await store.put_request(request, ttl_s=60.0)
            assert await store.get_request("r-1") == request
            assert 0 < await store._redis.pttl(store._keys.request("r-1")) <= 60_000

            assert await store.append_emitted("r-1", [13, 14], updated=T0 + 1) == 4
            assert await store.append_emitted("r-1", []) == 4
            await asyncio.gather(*(store.append_emitted("r-1", [100 + i]) for i in range(50)))
            stored = await store.get_request("r-1")
            assert stored is not None
            assert stored.emitted_token_ids[:4] == [11, 12, 13, 14]
            assert sorted(stored.emitted_token_ids[4:]) == [100 + i for i in range(50)]
            assert (stored.stages, stored.updated) == (stages, T0 + 1)

            assert await store.append_emitted("r-missing", [1]) is None
            assert await store.get_request("r-missing") is None  # not resurrected without TTL
            assert await store.delete_request("r-1")
            assert await store.get_request("r-1") is None

    run(scenario())


def test_perf_coefficients_and_nixl_metadata_round_trip(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            coefficients = {"prefill": [0.001, 2.5e-5], "decode": {"alpha": 0.01}, "gpu": "cpu"}
            await store.put_perf("w-1", coefficients)
            assert await store.get_perf("w-1") == coefficients
            assert await store.get_perf("w-2") is None
            metadata = bytes(range(256)) * 4  # not valid utf-8
            await store.put_nixl_metadata("w-1", metadata)
            assert await store.get_nixl_metadata("w-1") == metadata

    run(scenario())


# ---- leader lock and rate limiting ---------------------------------------------------


def test_leader_lock_fencing_token_grows_across_holders(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            first = await store.try_acquire_leader("scheduler", "replica-a", ttl_s=0.3)
            assert first is not None
            assert await store.try_acquire_leader("scheduler", "replica-b", ttl_s=0.3) is None
            assert await store.try_acquire_leader("scheduler", "replica-a", ttl_s=0.3) == first

            tokens: list[int] = []

            async def b_acquires() -> bool:
                token = await store.try_acquire_leader("scheduler", "replica-b", ttl_s=30.0)
                tokens.extend([token] if token is not None else [])
                return token is not None

            await wait_until(b_acquires, "replica-a's lock to expire")
            second = tokens[0]
            assert second > first
            assert await store.try_acquire_leader("scheduler", "replica-a", ttl_s=30.0) is None
            assert not await store.release_leader("scheduler", "replica-a")
            assert await store.release_leader("scheduler", "replica-b")
            third = await store.try_acquire_leader("scheduler", "replica-a", ttl_s=30.0)
            assert third is not None and third > second

    run(scenario())


def test_token_bucket_allows_a_burst_then_refuses_with_retry_hint(prefix: str) -> None:
    async def scenario() -> None:
        async with open_store(prefix) as store:
            take = store.take_token
            for _ in range(3):
                assert await take("tenant-a", rate_per_s=2.0, burst=3, now=T0) == (True, 0.0)
            allowed, retry_after = await take("tenant-a", rate_per_s=2.0, burst=3, now=T0)
            assert not allowed
            assert retry_after == pytest.approx(0.5)  # one token at 2 tokens/s
            allowed, retry_after = await take("tenant-a", rate_per_s=2.0, burst=3, now=T0 + 0.25)
            assert not allowed and retry_after == pytest.approx(0.25)
            assert (await take("tenant-a", rate_per_s=2.0, burst=3, now=T0 + 0.5))[0]
            assert (await take("tenant-b", rate_per_s=2.0, burst=3, now=T0))[0]  # own bucket

    run(scenario())


# ---- connection failures -------------------------------------------------------------


def test_unreachable_redis_raises_state_unavailable_quickly(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RedisRetryPolicy(attempts=3, base_delay_s=0.05, max_delay_s=0.2, socket_timeout_s=0.5)

    async def scenario(url: str) -> StateUnavailableError:
        store = StateStore(url, prefix=prefix, retry_policy=policy)
        try:
            with pytest.raises(StateUnavailableError) as raised:
                await store.connect()
            return raised.value
        finally:
            await store.close()

    # A bound socket that never listens: connections to its port are refused.
    with socket.socket() as unused, caplog.at_level(logging.WARNING, logger="splitserve.state.store"):
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        started = time.monotonic()
        error = run(scenario(f"redis://127.0.0.1:{port}/0"))
        elapsed = time.monotonic() - started
    assert elapsed < 3.0
    assert error.attempts == 3
    assert error.last_error is not None
    assert f"127.0.0.1:{port}" in str(error)
    retries_logged = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(retries_logged) == 2  # one per retry, none after the last attempt


def test_commands_on_a_lost_redis_raise_state_unavailable_after_retries(prefix: str) -> None:
    policy = RedisRetryPolicy(
        attempts=1, base_delay_s=0.05, max_delay_s=0.1, reconnect_retries=2, socket_timeout_s=0.5
    )

    async def scenario(url: str) -> StateUnavailableError:
        store = StateStore(url, prefix=prefix, retry_policy=policy)
        try:
            with pytest.raises(StateUnavailableError) as raised:
                await store.get_loads()
            return raised.value
        finally:
            await store.close()

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        started = time.monotonic()
        error = run(scenario(f"redis://127.0.0.1:{unused.getsockname()[1]}/0"))
    assert time.monotonic() - started < 3.0
    assert error.attempts == 3  # the first try plus reconnect_retries
    assert isinstance(error.last_error, RedisConnectionError)
