"""Per-API-key rate limits shared through Redis (issue 18, overload): requests and tokens per minute.

The gateway's HTTP app in-process (fake coordinator) over a real Redis: a key over its limit
gets 429 with Retry-After and an OpenAI error body, another key is unaffected, two gateways
share one budget, a request larger than a minute's tokens is a 400 naming the limit, and a
limiter whose Redis does not answer lets requests through (and counts them). Both buckets are
taken in one script, all or nothing; they refill by Redis's clock whatever a gateway's says; the
output tokens a request did not generate go back to its bucket when it ends.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import httpx
import pytest

from gateway.core import GatewayCore
from gateway.http_api import create_app
from gateway.rate_limit import KeyRateLimiter
from gateway.tokenization import Tokenization
from splitserve.config import GatewayConfig
from splitserve.errors import Overloaded
from splitserve.keys import plain_key_owner
from splitserve.state.store import RedisRetryPolicy, StateStore
from tests.unit.test_gateway_hint import ByteTokenizer, RecordingCoordinator

KEYS = ["key-alpha", "key-beta"]


def _gateway(prefix: str, redis_url: str | None = None, **limits) -> GatewayCore:
    config = GatewayConfig(model="/models/demo", api_keys=KEYS, default_max_tokens=8, max_tokens_limit=64)
    store = StateStore(redis_url or os.environ["SPLITSERVE_TEST_REDIS_URL"], prefix,
                       retry_policy=RedisRetryPolicy(attempts=1))
    return GatewayCore(config, Tokenization(ByteTokenizer(), max_model_len=128), RecordingCoordinator(),
                       KeyRateLimiter(store, **limits))


def _post(cores_and_keys, body=None):
    """POST /v1/completions once per (core, key), in order; the responses."""
    async def run():
        replies = []
        for core, key in cores_and_keys:
            transport = httpx.ASGITransport(app=create_app(core))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                replies.append(await client.post("/v1/completions", json=body or {"prompt": "hi", "max_tokens": 4},
                                                 headers={"authorization": f"Bearer {key}"}))
        return replies
    return asyncio.run(run())


def test_a_key_over_its_request_rate_gets_429_and_others_do_not():
    prefix = f"ss:rl-{uuid.uuid4().hex[:8]}:"
    one, other = _gateway(prefix, requests_per_minute=3), _gateway(prefix, requests_per_minute=3)
    # Two gateway replicas share the key's budget: 3 requests in all, the 4th is refused.
    replies = _post([(one, KEYS[0]), (other, KEYS[0]), (one, KEYS[0]), (other, KEYS[0]), (one, KEYS[1])])
    assert [r.status_code for r in replies] == [200, 200, 200, 429, 200]
    refused = replies[3]
    assert float(refused.headers["retry-after"]) > 0
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "3 requests per minute" in error["message"]


def test_tokens_per_minute_count_prompt_plus_max_tokens():
    prefix = f"ss:rl-{uuid.uuid4().hex[:8]}:"
    core = _gateway(prefix, tokens_per_minute=40)
    body = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_tokens": 10}  # 20 tokens each
    assert [r.status_code for r in _post([(core, KEYS[0])] * 3, body)] == [200, 200, 429]
    too_big = _post([(core, KEYS[1])], {"prompt": [1] * 10, "max_tokens": 40})[0]  # 50 > 40: never passes
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"


def test_a_limiter_whose_redis_does_not_answer_lets_requests_through():
    from splitserve.redis_server import free_port

    core = _gateway("ss:rl-down:", redis_url=f"redis://127.0.0.1:{free_port()}/0", requests_per_minute=1)
    assert [r.status_code for r in _post([(core, KEYS[0])] * 3)] == [200, 200, 200]


# ---- one script for both buckets, Redis's clock, unused tokens given back (issue 37) ----------


def _redis_level(prefix: str, bucket: str) -> float | None:
    """A bucket's stored level, read from Redis itself (None: no bucket, i.e. full)."""
    import redis

    client = redis.Redis.from_url(os.environ["SPLITSERVE_TEST_REDIS_URL"], decode_responses=True)
    try:
        level = client.hget(f"{prefix}ratelimit:{bucket}", "tokens")
    finally:
        client.close()
    return None if level is None else float(level)


def test_a_request_refused_by_one_bucket_takes_nothing_from_the_other():
    prefix = f"ss:rl-{uuid.uuid4().hex[:8]}:"

    async def run():
        store = StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], prefix, retry_policy=RedisRetryPolicy(attempts=1))
        try:
            limiter = KeyRateLimiter(store, requests_per_minute=2, tokens_per_minute=40)
            await limiter.check("owner-a", 30)
            with pytest.raises(Overloaded, match="40 tokens per minute"):
                await limiter.check("owner-a", 30)  # 10 tokens left: refused for tokens ...
            assert _redis_level(prefix, "requests:owner-a") == pytest.approx(1.0, abs=0.01)  # ... request kept
            await limiter.check("owner-a", 10)  # so the second request of the minute still passes
            with pytest.raises(Overloaded, match="2 requests per minute"):
                await limiter.check("owner-a", 1)
            # The other way round: refused for requests, the token bucket keeps its tokens.
            one = KeyRateLimiter(store, requests_per_minute=1, tokens_per_minute=100)
            await one.check("owner-b", 10)
            with pytest.raises(Overloaded, match="1 requests per minute"):
                await one.check("owner-b", 10)
            assert _redis_level(prefix, "tokens:owner-b") == pytest.approx(90.0, abs=0.5)
        finally:
            await store.close()
    asyncio.run(run())


def test_unused_output_tokens_go_back_when_a_request_ends():
    prefix = f"ss:rl-{uuid.uuid4().hex[:8]}:"
    core = _gateway(prefix, tokens_per_minute=40)
    bucket = f"tokens:{plain_key_owner(KEYS[0].encode())}"

    async def run():
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            async def post(max_tokens):
                reply = await client.post("/v1/completions", json={"prompt": [1] * 10, "max_tokens": max_tokens},
                                          headers={"authorization": f"Bearer {KEYS[0]}"})
                return reply.status_code
            assert await post(30) == 200  # charged 10 + 30 = the whole minute; generated 1 token
            # The 29 tokens it did not generate go back (in the background: poll Redis, bounded).
            for _ in range(500):
                level = _redis_level(prefix, bucket)
                if level is not None and level >= 29:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"unused tokens not given back: the bucket holds {level}")
            assert level < 30  # the prompt and the generated token stay spent
            assert await post(19) == 200  # 29 tokens: fits only thanks to the give-back
            assert await post(19) == 429  # and the limit still holds
    asyncio.run(run())


@pytest.mark.parametrize("skew_s", [60.0, -60.0, 3600.0])
def test_a_gateway_with_a_skewed_clock_limits_as_the_others(monkeypatch, skew_s):
    """The buckets refill by Redis's clock: a replica whose own clock is a minute (or an hour)
    off neither refills a bucket early nor stalls it. Each gateway's wall clock is `time.time`
    (the only clock a gateway has), set for the duration of each of its requests."""
    true_time = time.time
    skew = [0.0]
    monkeypatch.setattr(time, "time", lambda: true_time() + skew[0])

    def post_with_clocks(calls):
        async def run():
            replies = []
            for core, key, offset in calls:
                skew[0] = offset
                transport = httpx.ASGITransport(app=create_app(core))
                async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                    reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                                              headers={"authorization": f"Bearer {key}"})
                replies.append(reply.status_code)
            skew[0] = 0.0
            return replies
        return asyncio.run(run())

    for first, last in ((0.0, skew_s), (skew_s, 0.0)):  # the skewed replica last, then first
        prefix = f"ss:rl-{uuid.uuid4().hex[:8]}:"
        one, other = _gateway(prefix, requests_per_minute=3), _gateway(prefix, requests_per_minute=3)
        calls = [(one, KEYS[0], first)] * 3 + [(other, KEYS[0], last)]
        assert post_with_clocks(calls) == [200, 200, 200, 429], (first, last)


def test_a_limiter_whose_redis_does_not_answer_counts_what_it_lets_through():
    from gateway.rate_limit import UNAVAILABLE
    from splitserve.redis_server import free_port

    core = _gateway("ss:rl-down:", redis_url=f"redis://127.0.0.1:{free_port()}/0", requests_per_minute=1,
                    tokens_per_minute=100)
    before = UNAVAILABLE._value.get()
    assert [r.status_code for r in _post([(core, KEYS[0])] * 3)] == [200, 200, 200]
    assert UNAVAILABLE._value.get() == before + 3
