"""What the tests that use the real Redis share: its URL, cleanup of a prefix, a final request record."""

from __future__ import annotations

import asyncio
import os
import time

import redis.asyncio as aioredis

from splitserve.state.store import StateStore

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


async def delete_prefixed(prefix: str) -> None:
    """Delete every key under `prefix` (a test's own prefix, after the test)."""
    client = aioredis.Redis.from_url(REDIS_URL, socket_connect_timeout=2.0)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def final_request_record(cluster, request_id: str, timeout_s: float = 10.0):
    """The request's record once it says how the request ended (the coordinator writes records
    behind, in batches: right after a request ends, Redis may still hold "running" or nothing),
    or whatever was last read when `timeout_s` ran out, for the caller's assertion to show."""
    async def read():
        deadline = time.monotonic() + timeout_s
        async with StateStore(cluster.redis_url, cluster.redis_prefix) as store:
            while True:
                record = await store.get_request(request_id)
                if (record is not None and record.state != "running") or time.monotonic() > deadline:
                    return record
                await asyncio.sleep(0.02)  # polling the batched record write, bounded by the deadline
    return asyncio.run(read())
