"""The output-length hint through the gateway's HTTP app and gRPC servicer (fake coordinator), and the SDK option.

The HTTP API runs in-process over an ASGI transport, the gRPC servicer is called with a
stub context; what reaches the coordinator is the SubmitRequest each builds.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.coordinator_client import GenerationDelta
from gateway.core import GatewayCore
from gateway.grpc_api import GatewayServicer
from gateway.http_api import create_app
from gateway.tokenization import Tokenization
from splitserve.client import GenerateOptions, build_generate_request
from splitserve.config import GatewayConfig
from splitserve.proto import gateway_pb2, types_pb2
from gateway_support import ByteTokenizer


class RecordingCoordinator:
    """Records each SubmitRequest and answers one token."""

    def __init__(self):
        self.submitted = []

    async def generate(self, request, timeout_s=None, trace_context=None):
        self.submitted.append(request.submit_request())
        yield GenerationDelta("A", [65], "stop", len(request.prompt_token_ids), 1)

    async def ready(self, timeout_s: float = 1.0, engine_family: str = "") -> tuple[bool, str]:
        return True, ""

    async def close(self) -> None:
        pass


@pytest.fixture
def gateway():
    coordinator = RecordingCoordinator()
    config = GatewayConfig(model="/models/demo", default_max_tokens=16, max_tokens_limit=64)
    return GatewayCore(config, Tokenization(ByteTokenizer(), max_model_len=128), coordinator), coordinator


def post(core: GatewayCore, path: str, body: dict, headers: dict | list | None = None) -> httpx.Response:
    async def call():
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post(path, json=body, headers=headers)
    return asyncio.run(call())


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)])
def test_http_hint_from_header_or_body_reaches_the_coordinator(gateway, path, body):
    core, coordinator = gateway
    assert post(core, path, {**body, "max_tokens": 40}, {"x-predicted-output-len": "33"}).status_code == 200
    assert post(core, path, {**body, "max_tokens": 40, "predicted_output_len": 5},
                {"X-Predicted-Output-Len": "33"}).status_code == 200  # the body wins over the header
    assert post(core, path, {**body, "max_tokens": 40, "predicted_output_len": 900}).status_code == 200  # clamped
    assert post(core, path, body).status_code == 200
    hints = [s.predicted_output_len if s.HasField("predicted_output_len") else None for s in coordinator.submitted]
    assert hints == [33, 5, 40, None]


@pytest.mark.parametrize("body,headers,param", [
    ({"predicted_output_len": -3}, None, "predicted_output_len"),
    ({"predicted_output_len": "3"}, None, "predicted_output_len"),
    ({}, {"x-predicted-output-len": "-3"}, "x-predicted-output-len"),
    ({}, {"x-predicted-output-len": "three"}, "x-predicted-output-len"),
    ({}, [("x-predicted-output-len", "3"), ("x-predicted-output-len", "4")], "x-predicted-output-len"),
])
def test_http_bad_hint_is_400_naming_it_and_never_reaches_the_coordinator(gateway, body, headers, param):
    core, coordinator = gateway
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)):
        reply = post(core, path, {**base, **body}, headers)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_argument")
        assert param in error["message"]
    assert coordinator.submitted == []
    assert post(core, "/v1/completions", {"prompt": "hi"}).status_code == 200  # and the gateway keeps serving


class StubContext:
    """Enough of grpc.aio.ServicerContext for Generate."""

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_grpc_hint_reaches_the_coordinator_clamped_and_absent_stays_absent(gateway):
    core, coordinator = gateway
    servicer = GatewayServicer(core)

    async def generate(**fields):
        request = gateway_pb2.GenerateRequest(text="hi", sampling=types_pb2.SamplingParams(max_tokens=20), **fields)
        return [r async for r in servicer.Generate(request, StubContext())]

    async def scenario():
        for fields in ({"predicted_output_len": 7}, {"predicted_output_len": 0}, {"predicted_output_len": 10**6}, {}):
            responses = await generate(**fields)
            assert responses[-1].finish_reason == "stop"
    asyncio.run(scenario())
    hints = [s.predicted_output_len if s.HasField("predicted_output_len") else None for s in coordinator.submitted]
    assert hints == [7, 0, 20, None]


def test_sdk_option_sets_the_field_only_when_given():
    assert not build_generate_request("hi").HasField("predicted_output_len")
    hinted = build_generate_request("hi", GenerateOptions(predicted_output_len=300), max_tokens=512)
    assert hinted.HasField("predicted_output_len") and hinted.predicted_output_len == 300
    assert build_generate_request("hi", predicted_output_len=0).HasField("predicted_output_len")
    for bad in (-1, 2**32, 1.5, True, "12"):
        with pytest.raises(ValueError, match="predicted_output_len"):
            build_generate_request("hi", predicted_output_len=bad)
