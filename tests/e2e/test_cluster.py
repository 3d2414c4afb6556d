"""The whole cluster as real processes: SDK and OpenAI HTTP API against the offline engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid

import grpc
import httpx
import pytest

from splitserve.client import AsyncClient, Client
from splitserve.proto import worker_pb2, worker_pb2_grpc
from splitserve.state.store import StateStore
from workers.engine import LLM, SamplingParams
from redis_support import final_request_record

PROMPTS = ["Hello, splitserve!", "The quick brown fox", "x"]


@pytest.fixture(scope="module")
def reference_llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["llama"]))


@pytest.fixture(scope="module")
def sdk(cluster):
    with Client(cluster.gateway_grpc, timeout_s=60) as client:
        yield client


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.gateway_http, timeout=60) as client:
        yield client


def _model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _poll(predicate, timeout_s=15.0, interval_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)  # polling a condition, bounded by the deadline
    return False


def _all_blocks_free(cluster) -> bool:
    for address in cluster.worker_addresses:
        with grpc.insecure_channel(address) as channel:
            load = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
        if load.free_blocks != load.total_blocks or load.running or load.waiting:
            return False
    return True


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 1234)])
def test_sdk_matches_offline_engine(sdk, reference_llm, temperature, seed):
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True)
    expected = reference_llm.generate(PROMPTS, params)
    for prompt, exp in zip(PROMPTS, expected):
        got = sdk.generate(prompt, max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True)
        assert got.token_ids == exp.token_ids
        assert got.text == exp.text
        assert got.finish_reason == "length"
        assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert got.usage.completion_tokens == 12
        streamed = list(sdk.stream(prompt, max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True))
        assert [t for c in streamed for t in c.token_ids] == exp.token_ids
        assert streamed[-1].finish_reason == "length" and streamed[-1].usage.completion_tokens == 12


def test_token_id_prompts_match_offline_engine(sdk, reference_llm):
    prompt = [5, 17, 200, 33, 9, 250]
    exp = reference_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert sdk.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids == exp.token_ids


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.7, 99)])
def test_http_completions_match_offline_engine(http, reference_llm, temperature, seed):
    model = _model_id(http)
    for prompt in PROMPTS:
        exp = reference_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=temperature, seed=seed,
                                                             ignore_eos=True))[0]
        body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": temperature, "ignore_eos": True}
        if seed is not None:
            body["seed"] = seed
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert data["choices"][0]["text"] == exp.text
        assert data["usage"] == {"prompt_tokens": len(exp.prompt_token_ids), "completion_tokens": 10,
                                 "total_tokens": len(exp.prompt_token_ids) + 10}
        # streaming: SSE chunks ending in [DONE], usage chunk when asked for
        text, usage, done = "", None, False
        with http.stream("POST", "/v1/completions",
                         json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
        assert done and text == exp.text and usage["completion_tokens"] == 10


def test_http_chat_completions(http, reference_llm, tiny_model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dirs["llama"]))
    messages = [{"role": "user", "content": "hi there"}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    exp = reference_llm.generate([list(prompt_ids)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    reply = http.post("/v1/chat/completions", json={"model": _model_id(http), "messages": messages, "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": exp.text}
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)


def test_32_concurrent_streams_complete_and_spread_over_workers(cluster):
    async def ttft_counts():
        async with StateStore(cluster.redis_url, cluster.redis_prefix) as store:
            return {w: (await store.window_stats(w, "ttft", window_s=600)).count for w in ("worker-0", "worker-1")}

    before = asyncio.run(ttft_counts())

    async def one(client, i):
        chunks = [c async for c in client.stream(f"request {i}", max_tokens=6 + i % 5, temperature=0.5, seed=i,
                                                ignore_eos=True)]
        return i, chunks

    async def run_all():
        async with AsyncClient(cluster.gateway_grpc, timeout_s=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    for i, chunks in results:
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(tokens) == 6 + i % 5
        assert chunks[-1].usage.completion_tokens == 6 + i % 5
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(tokens)
    after = asyncio.run(ttft_counts())
    assert all(after[w] > before[w] for w in after), f"both workers should get work: {before} -> {after}"


def test_sdk_cancel_frees_worker_blocks(cluster):
    assert _poll(lambda: _all_blocks_free(cluster))
    request_id = f"cancel-{uuid.uuid4().hex}"
    with Client(cluster.gateway_grpc, timeout_s=60) as client:
        stream = client.stream("cancel me", max_tokens=240, temperature=0.0, ignore_eos=True, request_id=request_id)
        for i, _ in enumerate(stream):
            if i == 3:
                assert not _all_blocks_free(cluster)
                break
        stream.close()
    assert _poll(lambda: _all_blocks_free(cluster)), "blocks not freed after SDK cancel"
    # Freed because the cancel reached the coordinator, not because the 240 tokens ran out.
    record = final_request_record(cluster, request_id)
    assert record.state == "cancelled" and len(record.emitted_token_ids) < 240, record


def test_http_client_disconnect_frees_worker_blocks(cluster, http):
    assert _poll(lambda: _all_blocks_free(cluster))
    body = {"model": _model_id(http), "prompt": "disconnect", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=cluster.gateway_http, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            request_id = stream.headers["x-request-id"]
            lines = 0
            for line in stream.iter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    assert not _all_blocks_free(cluster)
                    break
    assert _poll(lambda: _all_blocks_free(cluster)), "blocks not freed after HTTP disconnect"
    # Freed because the disconnect cancelled the request, not because its 240 tokens ran out.
    record = final_request_record(cluster, request_id)
    assert record.state == "cancelled" and len(record.emitted_token_ids) < 240, record


@pytest.mark.parametrize(
    "body, status, param, needle",
    [
        ({"prompt": ""}, 400, "prompt", "prompt"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens", "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
        ({"prompt": "hi", "model": "no-such-model"}, 404, "model", "no-such-model"),
    ],
)
def test_http_bad_input(http, body, status, param, needle):
    full = {"model": _model_id(http), "max_tokens": 4, **body}
    reply = http.post("/v1/completions", json=full)
    assert reply.status_code == status, reply.text
    err = reply.json()["error"]
    assert needle in err["message"] and err["param"] == param and err["type"]
    assert http.post("/v1/completions", json={"model": _model_id(http), "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_http_malformed_json(http):
    reply = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert "JSON" in reply.json()["error"]["message"] or "json" in reply.json()["error"]["message"]


def test_sdk_bad_input(sdk):
    from splitserve.client import InvalidRequestError

    for kwargs, needle in [({"prompt": ""}, "prompt"), ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
                           ({"prompt": "hi", "temperature": -0.5}, "temperature")]:
        prompt = kwargs.pop("prompt")
        with pytest.raises(InvalidRequestError) as err:
            sdk.generate(prompt, **{"max_tokens": 4, **kwargs})
        assert needle in str(err.value)
    assert len(sdk.generate("still serving", max_tokens=3, temperature=0).token_ids) == 3


def test_oversized_grpc_message_is_rejected(cluster, sdk):
    from splitserve.client import SplitserveClientError

    huge = [7] * (2 << 20)  # > the gateway's 1 MiB message limit in this cluster
    with pytest.raises(SplitserveClientError) as err:
        sdk.generate(huge, max_tokens=2)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in str(err.value), str(err.value)
    assert len(sdk.generate("after", max_tokens=2, temperature=0).token_ids) == 2


@pytest.fixture(scope="module")
def keyed_gateway(cluster, tiny_model_dirs):
    """A second gateway on the same cluster that requires an API key."""
    from splitserve.cli.launcher import _serve_cmd, wait_port_healthy
    from splitserve.redis_server import free_port

    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen(_serve_cmd("gateway", {
        "port": grpc_port, "http_port": http_port, "model": str(tiny_model_dirs["llama"]),
        "coordinator_address": cluster.coordinator_address, "api_keys": "sekrit,other",
        "redis_url": cluster.redis_url, "redis_prefix": cluster.redis_prefix, "metrics_port": 0,
    }), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port_healthy(f"127.0.0.1:{grpc_port}", proc, 60)
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_api_keys_on_both_apis(keyed_gateway):
    from splitserve.client import AuthenticationError

    grpc_target, base = keyed_gateway
    body = {"model": "llama", "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=base, timeout=30) as client:
        model = client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).json()["data"][0]["id"]
        body["model"] = model
        missing = client.post("/v1/completions", json=body)
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        good = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer other"})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert wrong.status_code == 401
    assert good.status_code == 200
    for key in (None, "nope"):
        with Client(grpc_target, api_key=key, timeout_s=30) as client, pytest.raises(AuthenticationError):
            client.generate("hi", max_tokens=2)
    with Client(grpc_target, api_key="sekrit", timeout_s=30) as client:
        assert len(client.generate("hi", max_tokens=2, temperature=0).token_ids) == 2


@pytest.mark.parametrize("service", ["scheduler", "coordinator", "worker"])
def test_redis_unavailable_at_start_fails_clearly(service, tiny_model_dirs):
    from splitserve.cli.launcher import _serve_cmd
    from splitserve.redis_server import free_port

    options = {"redis_url": f"redis://127.0.0.1:{free_port()}/0", "redis_connect_attempts": 2,
               "port": free_port(), "metrics_port": 0, "log_json": False}
    if service == "worker":
        options["model"] = str(tiny_model_dirs["llama"])
    started = time.monotonic()
    proc = subprocess.run(_serve_cmd(service, options), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "Redis" in output and options["redis_url"] in output and "Traceback" not in output, output[-3000:]
    assert time.monotonic() - started < 45
