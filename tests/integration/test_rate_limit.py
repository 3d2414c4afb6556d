"""Per-API-key rate limits shared through Redis (issue 18, overload): requests and tokens per minute.

The gateway's HTTP app in-process (fake coordinator) over a real Redis: a key over its limit
gets 429 with Retry-After and an OpenAI error body, another key is unaffected, two gateways
share one budget, a request larger than a minute's tokens is a 400 naming the limit, and a
limiter whose Redis does not answer lets requests through.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import httpx

from gateway.core import GatewayCore
from gateway.http_api import create_app
from gateway.rate_limit import KeyRateLimiter
from gateway.tokenization import Tokenization
from splitserve.config import GatewayConfig
from splitserve.state import RedisRetryPolicy, StateStore
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
