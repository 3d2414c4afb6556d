"""`priority` through a real gateway (embedded coordinator, placement in-process), real gRPC,
HTTP and Redis, and a stand-in worker that records the stages it is sent: under `fcfs`
scheduling a nonzero priority is refused (HTTP 400 / INVALID_ARGUMENT naming `priority`, as
vLLM refuses it without `--scheduling-policy priority`); under `priority` it reaches the
worker's stage, where the core orders by it (tests/unit/test_priority_scheduling.py)."""

from __future__ import annotations

import asyncio
import os

import grpc
import httpx
import pytest

from gateway.server import EMBEDDED, GatewayServer
from gateway.tokenization import Tokenization
from splitserve.client import AsyncClient, InvalidRequestError
from splitserve.config import CoordinatorConfig, GatewayConfig, load_config
from splitserve.proto import types_pb2, worker_pb2_grpc
from splitserve.state.store import RedisRetryPolicy, StateStore, WorkerInfo, WorkerLoad
from gateway_support import ByteTokenizer

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
OUTPUT = [72, 105]


class RecordingWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.priorities: dict[str, int] = {}

    async def Execute(self, request, context):
        self.priorities[request.request_id] = request.priority
        yield types_pb2.TokenChunk(request_id=request.request_id, token_ids=OUTPUT, finish_reason="stop",
                                   num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=len(OUTPUT))


def _serve(prefix: str, scheduling_policy: str, send):
    """Start the worker and a gateway with `scheduling_policy`, run `send(grpc_port, http_port)`."""
    common = dict(redis_url=REDIS_URL, redis_prefix=prefix, metrics_port=0, host="127.0.0.1", log_json=False,
                  redis_connect_attempts=2)
    recorder = RecordingWorker()

    async def scenario():
        worker = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(recorder, worker)
        worker_port = worker.add_insecure_port("127.0.0.1:0")
        await worker.start()
        store = StateStore(REDIS_URL, prefix, retry_policy=RedisRetryPolicy(attempts=2, base_delay_s=0.05))
        await store.connect()
        await store.register_worker(WorkerInfo("w-0", f"127.0.0.1:{worker_port}", role="both",
                                               engine_kind="emulated"), ttl_s=30)
        await store.publish_load(WorkerLoad("w-0", role="both", engine_kind="emulated", free_blocks=100,
                                            total_blocks=100, block_size=16), ttl_s=30)
        gateway = GatewayServer(
            load_config(GatewayConfig, dict(common, port=0, http_port=0, coordinator_address=EMBEDDED,
                                            served_model_name="demo", scheduling_policy=scheduling_policy),
                        environ={}),
            Tokenization(ByteTokenizer(), max_model_len=512),
            load_config(CoordinatorConfig, dict(common, placement="local", policy="least_loaded",
                                                view_refresh_s=0.02), environ={}))
        try:
            await gateway.start()
            return await send(gateway.grpc_port, gateway.http_port)
        finally:
            await gateway.shutdown()
            await store.close()
            await worker.stop(0)

    return asyncio.run(scenario()), recorder.priorities


async def _send_both(grpc_port: int, http_port: int) -> dict[str, object]:
    outcomes: dict[str, object] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
        for name, body in (("http-0", {"prompt": "hi", "max_tokens": 2}),
                           ("http-3", {"prompt": "hi", "max_tokens": 2, "priority": 3}),
                           ("http-stream-3", {"prompt": "hi", "max_tokens": 2, "priority": 3, "stream": True})):
            response = await http.post("/v1/completions", json=body)
            outcomes[name] = (response.status_code, response.json() if response.status_code != 200 or
                              not body.get("stream") else None)
    async with AsyncClient(f"127.0.0.1:{grpc_port}", timeout_s=30) as client:
        for priority in (0, -1):
            try:
                result = await client.generate("hi", max_tokens=2, priority=priority, request_id=f"grpc{priority}")
                outcomes[f"grpc{priority}"] = result.finish_reason
            except InvalidRequestError as err:
                outcomes[f"grpc{priority}"] = err
    return outcomes


def test_fcfs_refuses_a_nonzero_priority_naming_it(prefix):
    outcomes, seen = _serve(prefix, "fcfs", _send_both)
    assert outcomes["http-0"][0] == 200 and outcomes["grpc0"] == "stop"
    for name in ("http-3", "http-stream-3"):
        status, body = outcomes[name]
        assert status == 400 and body["error"]["param"] == "priority", body
        assert "priority must be 0" in body["error"]["message"]
    refused = outcomes["grpc-1"]
    assert isinstance(refused, InvalidRequestError) and refused.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be 0" in str(refused)
    assert sorted(seen.values()) == [0, 0]  # the refused requests never reached a worker


def test_priority_scheduling_carries_it_to_the_worker(prefix):
    outcomes, seen = _serve(prefix, "priority", _send_both)
    assert [outcomes[n][0] for n in ("http-0", "http-3", "http-stream-3")] == [200, 200, 200]
    assert (outcomes["grpc0"], outcomes["grpc-1"]) == ("stop", "stop")
    assert seen["grpc-1"] == -1 and seen["grpc0"] == 0
    assert sorted(seen.values()) == [-1, 0, 0, 3, 3]
