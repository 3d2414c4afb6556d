"""Shared helpers of the tests that use the real Redis: its URL and the cleanup of a key prefix."""

from __future__ import annotations

import os

import redis.asyncio as aioredis

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
