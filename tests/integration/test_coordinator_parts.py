"""The coordinator's Redis-facing parts against a real Redis: batched records, local placement."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest

from services.coordinator.placement import LocalPlacer
from services.coordinator.records import RequestRecordWriter
from services.global_scheduler.policy import register_policy
from splitserve.errors import InvalidArgument, Unavailable
from splitserve.proto import scheduler_pb2, types_pb2
from splitserve.state.store import RedisRetryPolicy, RequestRecord, StateStore, WorkerInfo, WorkerLoad

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextlib.asynccontextmanager
async def open_store(prefix: str, **kwargs):
    store = StateStore(REDIS_URL, prefix, retry_policy=RedisRetryPolicy(attempts=2, base_delay_s=0.05), **kwargs)
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


async def _poll(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {check}")
        await asyncio.sleep(0.01)  # polling Redis, bounded by the deadline


def test_put_requests_writes_every_record_with_ttl(prefix):
    async def scenario():
        async with open_store(prefix) as store:
            records = [RequestRecord(f"r-{i}", "stop", [{"worker_id": "w", "start": 0, "end": i + 1, "emit": True}],
                                     list(range(i)), updated=1.0) for i in range(5)]
            await store.put_requests(records, ttl_s=30.0)
            for record in records:
                assert await store.get_request(record.request_id) == record
            assert 0 < await store._redis.pttl(store._keys.request("r-3")) <= 30_000
            await store.put_requests([], ttl_s=30.0)  # nothing to write is not an error
    asyncio.run(scenario())


def test_record_latencies_is_one_batch_of_window_samples(prefix):
    async def scenario():
        async with open_store(prefix) as store:
            now = time.time()
            await store.record_latencies("w-1", [0.1, 0.3], [0.01, 0.02, 0.03], now)
            ttft = await store.window_stats("w-1", "ttft", now=now)
            itl = await store.window_stats("w-1", "itl", now=now)
            assert (ttft.count, ttft.max) == (2, 0.3)
            assert (itl.count, itl.p50) == (3, 0.02)
            with pytest.raises(ValueError, match="finite"):
                await store.record_latencies("w-1", [float("nan")], [], now)
            await store.record_latencies("w-1", [], [], now)
    asyncio.run(scenario())


def test_record_writer_coalesces_by_request_and_flushes_in_the_background(prefix):
    async def scenario():
        async with open_store(prefix) as store:
            writer = RequestRecordWriter(store, ttl_s=30.0, flush_interval_s=0.01)
            writer.start()
            writer.put(RequestRecord("a", "running"))
            writer.put(RequestRecord("a", "stop", emitted_token_ids=[1, 2]))  # replaces the running one
            writer.put(RequestRecord("b", "running"))
            assert writer.pending == 2
            record = await _poll(lambda: store.get_request("a"))
            assert (record.state, record.emitted_token_ids) == ("stop", [1, 2])
            assert (await _poll(lambda: store.get_request("b"))).state == "running"
            writer.put(RequestRecord("c", "length"))
            await writer.close()  # flushes what is pending
            assert (await store.get_request("c")).state == "length"
    asyncio.run(scenario())


def test_record_writer_bounds_its_backlog(prefix):
    async def scenario():
        async with open_store(prefix) as store:
            writer = RequestRecordWriter(store, ttl_s=30.0, max_pending=2)
            for name in "xy":
                writer.put(RequestRecord(name, "running"))
            writer.put(RequestRecord("x", "stop"))  # an update of a pending record replaces it
            writer.put(RequestRecord("z", "running"))  # full: the oldest (y) makes room
            assert writer.pending == 2
            await writer.flush()
            assert (await store.get_request("x")).state == "stop"
            assert (await store.get_request("z")).state == "running"
            assert await store.get_request("y") is None
    asyncio.run(scenario())


class _Learning:
    """A policy that learns from completions: the coordinator must report to it."""

    name = "learning_for_test"

    def __init__(self):
        self.reports = []

    def place(self, request, view, now):
        from services.global_scheduler.policy import Placement
        return Placement.single_stage(view.eligible[0], request, self.name)

    def on_completion(self, report):
        self.reports.append(report)


def test_local_placer_places_on_the_redis_view_and_reports_only_to_learning_policies(prefix):
    register_policy("learning_for_test", _Learning)

    async def scenario():
        async with open_store(prefix) as store:
            for worker_id, running in (("w-a", 9), ("w-b", 0)):
                await store.register_worker(WorkerInfo(worker_id, "127.0.0.1:1", role="both", engine_kind="llama"))
                await store.publish_load(WorkerLoad(worker_id, role="both", engine_kind="llama",
                                                            free_blocks=100, total_blocks=100, block_size=16,
                                                            running=running), ttl_s=60)
            placer = LocalPlacer.from_config(store, "least_loaded", 0.5, view_refresh_s=0.02)
            await placer.start()
            try:
                plan = await placer.place(types_pb2.RequestMeta(request_id="r1", prompt_len=8, max_tokens=4), 2.0)
                assert [(s.worker_id, s.start, s.end, s.emit) for s in plan.stages] == [("w-b", 0, 12, True)]
                assert plan.policy == "least_loaded" and not plan.report_completion
                with pytest.raises(InvalidArgument, match="prompt_len"):
                    await placer.place(types_pb2.RequestMeta(request_id="r2", prompt_len=0), 2.0)
            finally:
                await placer.close()

            learning = LocalPlacer.from_config(store, "learning_for_test", 0.5, view_refresh_s=0.02)
            await learning.start()
            try:
                plan = await learning.place(types_pb2.RequestMeta(request_id="r3", prompt_len=8, max_tokens=4), 2.0)
                assert plan.report_completion
                await learning.report_completion(scheduler_pb2.CompletionReport(request_id="r3", finish_reason="stop"))
                assert [r.request_id for r in learning.policy.reports] == ["r3"]
            finally:
                await learning.close()

            with pytest.raises(ValueError, match="unknown placement policy"):
                LocalPlacer.from_config(store, "nope", 0.5, 0.05)
    asyncio.run(scenario())


def test_local_placer_without_workers_is_unavailable(prefix):
    async def scenario():
        async with open_store(prefix) as store:
            placer = LocalPlacer.from_config(store, "round_robin", 0.5, view_refresh_s=0.02)
            await placer.start()
            try:
                with pytest.raises(Unavailable):
                    await placer.place(types_pb2.RequestMeta(request_id="r", prompt_len=8, max_tokens=4), 2.0)
            finally:
                await placer.close()
    asyncio.run(scenario())
