"""Fixtures shared by the integration tests."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import redis.asyncio as aioredis

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def prefix(request):
    """A Redis key prefix of the test's own (named after its module); its keys are deleted after it."""
    tag = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    value = f"ss:test-{tag}-{uuid.uuid4().hex[:8]}:"
    yield value

    async def cleanup():
        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=f"{value}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    asyncio.run(cleanup())
