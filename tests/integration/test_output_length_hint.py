"""A client's output-length hint reaches the placement policy through a real gateway, coordinator and scheduler.

In this process, over real gRPC and HTTP, with real Redis: a gateway (embedded coordinator,
placement by the GlobalScheduler service), a scheduler whose policy records what it is
asked to place, and a stand-in worker that answers every stage with a few tokens. The
policy learns from completions, so the completion reports it receives are checked too:
they carry what `observe_completion` feeds the output-length predictor.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import httpx
import pytest

from gateway.server import EMBEDDED, GatewayServer
from gateway.tokenization import Tokenization
from services.global_scheduler.length_predictor import OutputLengthPredictor, observe_completion
from services.global_scheduler.policy import Placement, register_policy
from services.global_scheduler.server import start_scheduler
from splitserve.client import AsyncClient
from splitserve.config import CoordinatorConfig, GatewayConfig, SchedulerConfig, load_config
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc, types_pb2, worker_pb2_grpc
from splitserve.state.store import RedisRetryPolicy, StateStore, WorkerInfo, WorkerLoad
from gateway_support import ByteTokenizer

REDIS_URL = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POLICY = "hint_recording_for_test"
OUTPUT = [72, 105, 33]  # "Hi!"


class RecordingPolicy:
    """Places everything on the first worker and keeps what it saw."""

    name = POLICY

    def __init__(self) -> None:
        self.requests = []
        self.reports = []
        self.predictor = OutputLengthPredictor(min_samples=1, margin=0)

    def place(self, request, view, now):
        self.requests.append(request)
        return Placement.single_stage(view.eligible[0], request, self.name)

    def on_completion(self, report):
        self.reports.append(report)
        observe_completion(self.predictor, report)


class StandInWorker(worker_pb2_grpc.WorkerServicer):
    """Answers each stage with OUTPUT, finished by "stop"."""

    async def Execute(self, request, context):
        yield types_pb2.TokenChunk(request_id=request.request_id, token_ids=OUTPUT, finish_reason="stop",
                                   num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=len(OUTPUT))


async def _until_the_scheduler_sees(address: str, worker_id: str, timeout_s: float = 5.0) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            state = await stub.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=2)
            if any(w.worker_id == worker_id for w in state.workers):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"the scheduler's view never showed {worker_id}")
            await asyncio.sleep(0.02)  # polling the view refresh, bounded by the deadline


def test_hint_reaches_the_placement_policy_and_completions_feed_the_predictor(prefix):
    policy = RecordingPolicy()
    register_policy(POLICY, lambda: policy)
    common = dict(redis_url=REDIS_URL, redis_prefix=prefix, metrics_port=0, host="127.0.0.1", log_json=False,
                  redis_connect_attempts=2)

    async def scenario():
        worker = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(StandInWorker(), worker)
        worker_port = worker.add_insecure_port("127.0.0.1:0")
        await worker.start()
        store = StateStore(REDIS_URL, prefix, retry_policy=RedisRetryPolicy(attempts=2, base_delay_s=0.05))
        await store.connect()
        scheduler = await start_scheduler(load_config(SchedulerConfig, dict(
            common, port=0, policy=POLICY, view_refresh_s=0.02), environ={}))
        gateway = GatewayServer(
            load_config(GatewayConfig, dict(common, port=0, http_port=0, coordinator_address=EMBEDDED,
                                            served_model_name="demo"), environ={}),
            Tokenization(ByteTokenizer(), max_model_len=512),
            load_config(CoordinatorConfig, dict(common, placement="scheduler",
                                                scheduler_address=scheduler.address), environ={}))
        try:
            await store.register_worker(WorkerInfo("w-0", f"127.0.0.1:{worker_port}", role="both",
                                                   engine_kind="emulated"), ttl_s=30)
            await store.publish_load(WorkerLoad("w-0", role="both", engine_kind="emulated", free_blocks=100,
                                                total_blocks=100, block_size=16), ttl_s=30)
            await _until_the_scheduler_sees(scheduler.address, "w-0")
            await gateway.start()
            async with AsyncClient(f"127.0.0.1:{gateway.grpc_port}", timeout_s=30) as client:
                hinted = await client.generate("hello", max_tokens=64, predicted_output_len=40, request_id="grpc-hint")
                plain = await client.generate("hello", max_tokens=64, request_id="grpc-none")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}", timeout=30) as http:
                by_header = await http.post("/v1/completions", json={"prompt": "hey", "max_tokens": 50},
                                            headers={"x-predicted-output-len": "900"})
                refused = await http.post("/v1/completions", json={"prompt": "hey", "predicted_output_len": -1})
        finally:
            # First: its drain waits for the embedded coordinator's background completion
            # reports, which the scheduler (still up) hands to the policy.
            await gateway.shutdown()
            await scheduler.stop(grace_s=0)
            await store.close()
            await worker.stop(0)
        return hinted, plain, by_header, refused

    hinted, plain, by_header, refused = asyncio.run(scenario())
    assert (hinted.token_ids, plain.finish_reason, by_header.status_code) == (OUTPUT, "stop", 200)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "predicted_output_len"
    seen = {r.request_id: r for r in policy.requests}
    assert len(seen) == 3  # the refused request never reached placement
    assert seen["grpc-hint"].predicted_output_len == 40
    assert seen["grpc-none"].predicted_output_len is None  # no hint: the policy predicts
    by_http = next(r for rid, r in seen.items() if rid not in ("grpc-hint", "grpc-none"))
    assert (by_http.predicted_output_len, by_http.max_tokens) == (50, 50)  # clamped to max_tokens at the gateway
    assert sorted((r.finish_reason, r.output_tokens) for r in policy.reports) == [("stop", 3)] * 3
    assert policy.predictor.num_observed == 3 and policy.predictor.predict(len("hello") + 1) == 3
