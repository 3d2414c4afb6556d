"""The fast topology: coordinator inside the gateway process, placement inside the coordinator.

Same guarantees as the four-process cluster: exact tokens (here over two-stage split
plans, so the KV handover runs through the embedded coordinator too), request records in
Redis, cancellation freeing blocks, and a clean SIGTERM stop.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import grpc
import httpx
import pytest

from splitserve.client import Client
from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.proto import worker_pb2, worker_pb2_grpc
from splitserve.redis_server import free_port
from workers.engine import LLM, SamplingParams
from redis_support import final_request_record

PROMPT = [(i * 53 + 7) % 250 + 1 for i in range(23)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def embedded(tiny_model_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]), workers=2, policy="split", coordinator="embedded", placement="local",
        http_port=free_port(), grpc_port=free_port(), redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"],
        redis_prefix=f"ss:embedded-{uuid.uuid4().hex[:8]}:", log_dir=tmp_path_factory.mktemp("embedded-logs"),
        scheduler_args={"split_ratio": 0.5}, coordinator_args={"kv_chunk_tokens": 8},
        worker_args={"kv_cache_memory_bytes": 8 << 20, "max_num_seqs": 16, "block_size": 4, "kv_transport": "grpc"},
    )
    cluster = start_cluster(spec)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["llama"]))


def _poll(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)  # polling a condition, bounded by the deadline
    return False


def _all_blocks_free(cluster) -> bool:
    for address in cluster.worker_addresses:
        with grpc.insecure_channel(address) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
        if load.free_blocks != load.total_blocks or load.running or load.waiting:
            return False
    return True


def test_no_coordinator_process_runs(embedded):
    assert embedded.coordinator_address == "embedded"
    assert sorted(c.name for c in embedded.children) == ["gateway", "scheduler", "worker-0", "worker-1"]


@pytest.mark.parametrize("case", [dict(temperature=0.0), dict(temperature=0.8, top_k=40, seed=77)])
def test_split_requests_through_the_embedded_coordinator_are_exact(embedded, reference_llm, case):
    expected = reference_llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **case))[0]
    request_id = f"emb-{uuid.uuid4().hex[:8]}"
    with Client(embedded.gateway_grpc, timeout_s=60) as client:
        got = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id, **case)
        streamed = [t for c in client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **case)
                    for t in c.token_ids]
    assert got.token_ids == expected.token_ids
    assert streamed == expected.token_ids
    assert got.usage.completion_tokens == MAX_TOKENS
    record = final_request_record(embedded, request_id)
    assert record is not None and record.state == "length"
    split = -(-(len(PROMPT) + MAX_TOKENS) // 2)  # ceil(phi * L) with phi = 0.5
    assert [(s["start"], s["end"]) for s in record.stages] == [(0, split), (split, len(PROMPT) + MAX_TOKENS)]
    assert record.emitted_token_ids == expected.token_ids


def test_http_streaming_through_the_embedded_coordinator(embedded, reference_llm):
    expected = reference_llm.generate(["embedded"], SamplingParams(max_tokens=8, temperature=0.0,
                                                                    ignore_eos=True))[0]
    with httpx.Client(base_url=embedded.gateway_http, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        reply = http.post("/v1/completions", json={"model": model, "prompt": "embedded", "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected.text


def test_concurrent_requests_all_complete(embedded):
    async def run():
        from splitserve.client import AsyncClient

        async with AsyncClient(embedded.gateway_grpc, timeout_s=60) as client:
            return await asyncio.gather(*(client.generate(f"req {i}", max_tokens=6, ignore_eos=True)
                                          for i in range(16)))
    results = asyncio.run(run())
    assert all(r.usage.completion_tokens == 6 and r.finish_reason == "length" for r in results)


def test_cancel_frees_blocks_on_both_workers(embedded):
    assert _poll(lambda: _all_blocks_free(embedded))
    request_id = f"emb-cancel-{uuid.uuid4().hex[:8]}"
    with Client(embedded.gateway_grpc, timeout_s=60) as client:
        stream = client.stream(PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True, request_id=request_id)
        for i, _ in enumerate(stream):
            if i == 3:
                assert not _all_blocks_free(embedded)
                break
        stream.close()
    assert _poll(lambda: _all_blocks_free(embedded)), "blocks not freed after cancel"
    # The split (phi = 0.5) put it on both workers, and the cancel, not the 200 tokens' end, freed them.
    record = final_request_record(embedded, request_id)
    assert record is not None and record.state == "cancelled" and len(record.emitted_token_ids) < 200, record
    assert len({s["worker_id"] for s in record.stages}) == 2, record.stages
