"""LAPS' pool-controller loop on real Redis: one leader among scheduler replicas, a fencing
token that grows with every new leader, and a period that survives unreachable workers.

Workers here are registry records whose addresses refuse connections: the SetRole calls
fail for real over gRPC (UNAVAILABLE), which the loop must log and outlive; the calls that
succeed against live workers are covered by tests/e2e/test_laps_up.py.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from redis_support import REDIS_URL, delete_prefixed
from services.global_scheduler.pool_control import PoolControlLoop
from services.global_scheduler.pool_controller import PoolController, PoolControllerConfig
from services.global_scheduler.view import ClusterViewSource
from splitserve.redis_server import free_port
from splitserve.state.store import RedisRetryPolicy, StateStore, WorkerInfo, WorkerLoad



@pytest.fixture
def prefix():
    unique = f"sstest:pools:{uuid.uuid4().hex}:"
    yield unique
    asyncio.run(delete_prefixed(unique))


async def _replica(prefix: str, name: str, cool_down_s: float = 0.0
                   ) -> tuple[StateStore, ClusterViewSource, PoolControlLoop]:
    store = StateStore(REDIS_URL, prefix, retry_policy=RedisRetryPolicy(attempts=2, base_delay_s=0.05))
    await store.connect()
    views = ClusterViewSource(store, 0.02)
    await views.start()
    controller = PoolController(PoolControllerConfig(period_s=0.05, cool_down_s=cool_down_s))
    return store, views, PoolControlLoop(views, store, controller, holder=name, rpc_timeout_s=1.0)


def test_one_replica_leads_and_a_successor_gets_a_higher_fencing_token(prefix):
    async def scenario() -> None:
        a_store, a_views, a = await _replica(prefix, "scheduler-a")
        b_store, b_views, b = await _replica(prefix, "scheduler-b")
        try:
            for i in range(2):  # two unpooled prefill workers whose addresses refuse connections
                worker_id = f"p{i}"
                await a_store.register_worker(WorkerInfo(worker_id, f"127.0.0.1:{free_port()}", role="prefill",
                                                         engine_kind="emulated"), ttl_s=30)
                await a_store.publish_load(WorkerLoad(worker_id, role="prefill", engine_kind="emulated",
                                                      total_blocks=10, free_blocks=10, block_size=16), ttl_s=30)
            await a_views.refresh()
            await b_views.refresh()
            first = await a.tick()
            assert first is not None and a.leader and a.fencing_token > 0
            token = a.fencing_token
            # The SetRole calls failed (nothing listens): the period still decided and survived.
            assert [c.to_pool for c in first.assignments] == ["short", "long"]
            assert await b.tick() is None and not b.leader  # the lock is a's
            renewed = await a.tick()
            assert renewed is not None and a.fencing_token == token  # a renewal keeps the token
            await a.stop()  # releases the lock
            assert await b.tick() is not None and b.leader and b.fencing_token > token
        finally:
            for loop, views, store in ((a, a_views, a_store), (b, b_views, b_store)):
                await loop.stop()
                await views.stop()
                await store.close()

    asyncio.run(scenario())


def test_the_loop_keeps_running_its_periods_in_the_background(prefix):
    async def scenario() -> None:
        store, views, loop = await _replica(prefix, "scheduler-c")
        try:
            loop.start()
            deadline = asyncio.get_running_loop().time() + 10
            while not loop.decisions:  # polled, bounded by the deadline
                assert asyncio.get_running_loop().time() < deadline, "no control period ran"
                await asyncio.sleep(0.01)
            assert loop.leader
        finally:
            await loop.stop()
            await views.stop()
            await store.close()
        async with StateStore(REDIS_URL, prefix) as other:  # released at stop: another may lead at once
            assert await other.try_acquire_leader("pool-controller", "someone-else", ttl_s=1.0) is not None

    asyncio.run(scenario())


def test_a_move_whose_set_role_fails_is_not_counted_and_is_tried_again_next_period(prefix):
    async def scenario() -> None:
        store, views, loop = await _replica(prefix, "scheduler-d", cool_down_s=60.0)
        try:
            pools = {"p0": ("short", 200_000, 1.0), "p1": ("long", 0, 0.0), "p2": ("long", 0, 0.0)}
            ports: set[int] = set()
            while len(ports) < len(pools):  # distinct: one address is one worker in the view
                ports.add(free_port())
            for (worker_id, (pool, queued, busy)), port in zip(pools.items(), sorted(ports)):
                # nothing listens at these addresses
                await store.register_worker(WorkerInfo(worker_id, f"127.0.0.1:{port}", role="prefill",
                                                       engine_kind="emulated"), ttl_s=30)
                await store.publish_load(WorkerLoad(worker_id, role="prefill", engine_kind="emulated", pool=pool,
                                                    queued_prefill_tokens=queued, busy_fraction=busy,
                                                    total_blocks=10, free_blocks=10, block_size=16), ttl_s=30)
            deadline = asyncio.get_running_loop().time() + 10
            while len((await views.current()).by_role("prefill")) < 3:  # a read begun earlier may lack some
                assert asyncio.get_running_loop().time() < deadline, "the view never held the three workers"
                await views.refresh()
            first = await loop.tick()
            assert first is not None and first.move is not None and first.move.to_pool == "short"
            assert loop.controller.num_moves == 0  # its SetRole failed (UNAVAILABLE)
            second = await loop.tick()
            assert second is not None and second.move == first.move  # decided again, no cool-down started
        finally:
            await loop.stop()
            await views.stop()
            await store.close()

    asyncio.run(scenario())
