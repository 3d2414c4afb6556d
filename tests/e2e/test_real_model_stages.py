"""The real model (SmolLM2-135M-Instruct) on a local cluster of two workers.

A chat answer split across the workers, as prefill/decode disaggregation or at the middle of
its output, equals transformers' greedy tokens; through the OpenAI API the chat turn ends at
<|im_end|> with finish_reason "stop" and no special token in the text, as with vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import grpc
import httpx
import pytest
from real_model_support import (
    FRANCE,
    FRANCE_ANSWER,
    IM_END_ID,
    MAX_NEW_TOKENS,
    PHOTOSYNTHESIS,
    chat_prompt_ids,
    real_model_dir,
    transformers_greedy,
)

from splitserve.client import Client
from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from splitserve.redis_server import free_port
from splitserve.state.store import StateStore


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return chat_prompt_ids(tokenizer, PHOTOSYNTHESIS)


@pytest.fixture(scope="module")
def reference(model_dir, prompt):
    tokens = transformers_greedy(model_dir, [prompt], MAX_NEW_TOKENS)[0]
    assert len(tokens) == MAX_NEW_TOKENS and IM_END_ID not in tokens  # the answer runs past the split
    return tokens


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(
        model=str(model_dir), workers=2, policy="split", http_port=free_port(), grpc_port=free_port(),
        redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"], redis_prefix=f"ss:real-{uuid.uuid4().hex[:8]}:",
        log_dir=tmp_path_factory.mktemp("real-model-logs"),
        # 32 MiB of KV: ~700 tokens of this model (30 layers x 3 KV heads x 64 dims, float32)
        worker_args={"kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 8},
        coordinator_args={"kv_chunk_tokens": 16},
    )
    running = start_cluster(spec)
    yield running
    running.stop()


def _scheduler(cluster):
    return scheduler_pb2_grpc.GlobalSchedulerStub(grpc.insecure_channel(cluster.scheduler_address))


def _split_at(cluster, split: int, total: int) -> None:
    # phi = (s - 0.5) / L so that ceil(phi * L) == s exactly despite floating point.
    _scheduler(cluster).SetPolicy(scheduler_pb2.SetPolicyRequest(
        policy="split", params={"split_ratio": repr((split - 0.5) / total)}), timeout=5)


def _stages_of(cluster, request_id: str, timeout_s: float = 10.0) -> list[dict]:
    """The stages in the request's record; the coordinator writes records in batches, so poll."""
    async def read():
        deadline = time.monotonic() + timeout_s
        async with StateStore(cluster.redis_url, cluster.redis_prefix) as store:
            while True:
                record = await store.get_request(request_id)
                if record is not None and record.state != "running":
                    return record.stages
                if time.monotonic() > deadline:
                    return record.stages if record else []
                await asyncio.sleep(0.02)  # polling the record, bounded by the deadline
    return asyncio.run(read())


def _greedy(cluster, prompt: list[int], request_id: str) -> list[int]:
    with Client(cluster.gateway_grpc, timeout_s=300) as client:
        return client.generate(prompt, max_tokens=MAX_NEW_TOKENS, temperature=0.0, request_id=request_id).token_ids


def test_split_in_the_middle_of_the_output_equals_transformers(cluster, prompt, reference):
    total = len(prompt) + MAX_NEW_TOKENS
    split = len(prompt) + MAX_NEW_TOKENS // 2
    _split_at(cluster, split, total)
    request_id = f"real-split-{uuid.uuid4().hex[:6]}"
    assert _greedy(cluster, prompt, request_id) == reference
    stages = _stages_of(cluster, request_id)
    assert [(s["start"], s["end"]) for s in stages] == [(0, split), (split, total)]
    assert stages[0]["worker_id"] != stages[1]["worker_id"]


def test_pd_disaggregated_equals_transformers(cluster, prompt, reference):
    for i, role in enumerate(("prefill", "decode")):
        with grpc.insecure_channel(cluster.worker_addresses[i]) as channel:
            worker_pb2_grpc.WorkerStub(channel).SetRole(worker_pb2.SetRoleRequest(role=role), timeout=5)
    scheduler = _scheduler(cluster)
    scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(policy="pd_disaggregated"), timeout=5)
    deadline = time.monotonic() + 10
    while {w.role for w in scheduler.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=5).workers} != {
            "prefill", "decode"}:
        assert time.monotonic() < deadline, "roles never reached the scheduler's view"
        time.sleep(0.05)  # polling the scheduler's view, bounded by the deadline
    try:
        request_id = f"real-pd-{uuid.uuid4().hex[:6]}"
        assert _greedy(cluster, prompt, request_id) == reference
        stages = _stages_of(cluster, request_id)
        p, total = len(prompt), len(prompt) + MAX_NEW_TOKENS
        assert [(s["start"], s["end"], s["worker_id"]) for s in stages] == [(0, p, "worker-0"), (p, total, "worker-1")]
    finally:
        for address in cluster.worker_addresses:
            with grpc.insecure_channel(address) as channel:
                worker_pb2_grpc.WorkerStub(channel).SetRole(worker_pb2.SetRoleRequest(role="both"), timeout=5)


def test_openai_chat_turn_ends_at_im_end(cluster, tokenizer):
    """A chat request split after 4 answer tokens: the second worker meets <|im_end|>, the reply
    stops there and its text has no special token; streamed deltas add up to the same text."""
    prompt_len = len(chat_prompt_ids(tokenizer, FRANCE))
    max_tokens = 16
    _split_at(cluster, prompt_len + 4, prompt_len + max_tokens)
    with httpx.Client(base_url=cluster.gateway_http, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": FRANCE, "max_tokens": max_tokens, "temperature": 0.0}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["message"]["content"] == FRANCE_ANSWER
        assert choice["finish_reason"] == "stop"
        # Like vLLM: the end-of-turn token counts as generated, and stays out of the text.
        assert reply.json()["usage"]["completion_tokens"] == len(tokenizer.encode(FRANCE_ANSWER)) + 1

        deltas, finish = [], None
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for streamed in json.loads(line[len("data: "):])["choices"]:
                    deltas.append(streamed["delta"].get("content") or "")
                    finish = streamed.get("finish_reason") or finish
        assert "".join(deltas) == FRANCE_ANSWER and finish == "stop"

        # The rendered ChatML as a plain completion prompt: its special tokens are parsed, as vLLM does.
        text = tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
        completion = http.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": max_tokens,
                                                        "temperature": 0.0}).json()["choices"][0]
        assert (completion["text"], completion["finish_reason"]) == (FRANCE_ANSWER, "stop")
