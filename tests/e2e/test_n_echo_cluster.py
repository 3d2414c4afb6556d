"""OpenAI's `n` and completions' `echo` on whole local clusters (issue 37): a real gateway over
HTTP, real workers generating with the tiny Llama. n seeded choices that differ and come back
the same when asked again; n streamed, each chunk naming its choice and each choice finishing;
echo's text; echo with logprobs and max_tokens 0 (lm-eval-harness's loglikelihood request)
scoring the prompt as transformers does on the same model, on one worker and with the prompt's
prefill split over two workers (each stage scores the positions it computed)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc
from splitserve.redis_server import free_port
from splitserve.state.store import StateStore

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
# float32 on both sides; the engine's paged and chunked kernels differ from transformers' in
# the last bits only.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.gateway_http, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dirs) -> list[int]:
    return list(AutoTokenizer.from_pretrained(str(tiny_model_dirs["llama"]), local_files_only=True).encode(PROMPT))


@pytest.fixture(scope="module")
def reference(tiny_model_dirs, prompt_ids) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs["llama"]), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def _texts(answer: dict) -> list[str]:
    return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


def test_n_seeded_choices_differ_and_are_reproducible(http):
    body = {"prompt": PROMPT, "n": 3, "seed": 1234, "temperature": 1.0, "max_tokens": 12, "ignore_eos": True}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    texts = _texts(answer)
    assert len(set(texts)) == 3, texts
    assert answer["usage"]["completion_tokens"] == 36
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + 36
    assert _texts(http.post("/v1/completions", json=body).json()) == texts
    # Choice i is the request with seed 1234 + i (vLLM's parallel sampling): choice 1 alone.
    alone = http.post("/v1/completions", json={**body, "n": 1, "seed": 1235}).json()
    assert _texts(alone) == texts[1:2]


def test_n_greedy_choices_are_identical(http):
    answer = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                     "temperature": 0, "max_tokens": 6}).json()
    contents = [c["message"]["content"] for c in answer["choices"]]
    assert contents[0] == contents[1] and [c["index"] for c in answer["choices"]] == [0, 1]


def test_n_streamed_each_chunk_names_its_choice_and_each_choice_finishes(http):
    body = {"prompt": PROMPT, "n": 3, "seed": 99, "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    with http.stream("POST", "/v1/completions", json=body) as events:
        assert events.status_code == 200
        for line in events.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            (choice,) = chunk["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert sorted(texts) == [0, 1, 2]
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert usage["completion_tokens"] == 24
    whole = http.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert [texts[i] for i in range(3)] == _texts(whole)


def test_echo_returns_the_prompt_then_the_completion(http):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == PROMPT + plain


def _assert_scored_prompt(answer: dict, prompt_ids: list[int], reference: list[float]) -> None:
    choice = answer["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(reference, abs=TOLERANCE)
    assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])


def test_echo_logprobs_max_tokens_0_scores_the_prompt_as_transformers(http, prompt_ids, reference):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    _assert_scored_prompt(reply.json(), prompt_ids, reference)
    # Again: the prompt's KV is in the prefix cache now, and is computed anew for the scores.
    _assert_scored_prompt(http.post("/v1/completions", json=body).json(), prompt_ids, reference)


@pytest.fixture(scope="module")
def split_cluster(tiny_model_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]), workers=2, policy="split",
        http_port=free_port(), grpc_port=free_port(), redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"],
        redis_prefix=f"ss:n-echo-{uuid.uuid4().hex[:8]}:", log_dir=tmp_path_factory.mktemp("n-echo-logs"),
        coordinator_args={"kv_chunk_tokens": 8},
        worker_args={"kv_cache_memory_bytes": 8 << 20, "max_num_seqs": 16, "block_size": 4},
    )
    cluster = start_cluster(spec)
    yield cluster
    cluster.stop()


def _stages_of(cluster, request_id: str, timeout_s: float = 10.0) -> list[dict]:
    """The stages in the request's record (written in batches by the coordinator: polled)."""
    async def read():
        deadline = time.monotonic() + timeout_s
        async with StateStore(cluster.redis_url, cluster.redis_prefix) as store:
            while True:
                record = await store.get_request(request_id)
                if record is not None and record.state != "running" or time.monotonic() > deadline:
                    return record.stages if record else []
                await asyncio.sleep(0.02)  # polling the record, bounded by the deadline
    return asyncio.run(read())


def test_echo_logprobs_of_a_prompt_split_over_two_workers(split_cluster, prompt_ids, reference):
    total = len(prompt_ids) + 1  # max_tokens 0: the engine generates the one token the gateway drops
    split = len(prompt_ids) // 2
    scheduler = scheduler_pb2_grpc.GlobalSchedulerStub(grpc.insecure_channel(split_cluster.scheduler_address))
    # phi = (s - 0.5) / L so that ceil(phi * L) == s exactly despite floating point.
    scheduler.SetPolicy(scheduler_pb2.SetPolicyRequest(policy="split", params={
        "split_ratio": repr((split - 0.5) / total)}), timeout=5)
    with httpx.Client(base_url=split_cluster.gateway_http, timeout=120) as http:
        reply = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert reply.status_code == 200, reply.text
    stages = _stages_of(split_cluster, reply.headers["x-request-id"])
    assert [(s["start"], s["end"]) for s in stages] == [(0, split), (split, total)]
    assert stages[0]["worker_id"] != stages[1]["worker_id"]
    _assert_scored_prompt(reply.json(), prompt_ids, reference)
