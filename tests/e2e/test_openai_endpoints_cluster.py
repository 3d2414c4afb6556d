"""vLLM's /tokenize, /detokenize, /version, the chat max_tokens default, refused fields and
context_length_exceeded on a whole local cluster (issue 37): the real tokenizer and chat
template of the tiny Llama, a real gateway over HTTP, real workers generating.
"""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import pytest
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.gateway_http, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(str(tiny_model_dirs["llama"]), local_files_only=True)


@pytest.fixture(scope="module")
def max_model_len(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]


def chat_ids(tokenizer, messages, **options) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"])


def test_tokenize_matches_the_models_tokenizer_and_what_generation_counts(http, tokenizer, max_model_len):
    reply = http.post("/tokenize", json={"prompt": "Hello, splitserve!", "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    ids = tokenizer.encode("Hello, splitserve!")
    assert reply.json() == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                            "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == chat_ids(tokenizer, MESSAGES, add_generation_prompt=True)
    # The count is the prompt a chat completion is charged for.
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert reply.json()["usage"]["prompt_tokens"] == chat["count"]
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat_ids(tokenizer, MESSAGES, add_generation_prompt=False) != chat["tokens"]


def test_detokenize_gives_back_the_text(http, tokenizer):
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    reply = http.post("/detokenize", json={"tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    assert reply.json()["prompt"].endswith("The quick brown fox")
    bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_version(http):
    assert http.get("/version").json() == {"version": importlib.metadata.version("splitserve")}


def test_chat_without_max_tokens_generates_past_16_to_the_servers_limit(http, tokenizer, max_model_len):
    # The cluster's gateway runs with --max-tokens-limit 256, below the rest of this model's context.
    prompt_len = len(chat_ids(tokenizer, MESSAGES, add_generation_prompt=True))
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == min(256, max_model_len - prompt_len) > 16
    assert body["choices"][0]["finish_reason"] == "length"
    legacy = http.post("/v1/completions", json={"prompt": "Hello", "ignore_eos": True}).json()
    assert legacy["usage"]["completion_tokens"] == 16  # vLLM's legacy-completions default


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(http, max_model_len):
    long = [{"role": "user", "content": "x" * (max_model_len + 10)}]
    reply = http.post("/v1/chat/completions", json={"messages": long})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert error["message"].startswith(f"This model's maximum context length is {max_model_len} tokens")


@pytest.mark.parametrize("field,value", [("structural_tag", "{}"), ("include_stop_str_in_output", True)])
def test_fields_we_do_not_implement_are_refused_and_unknown_ones_served(http, field, value):
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
    served = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "x_vendor_knob": value})
    assert served.status_code == 200, served.text


def test_logprobs_come_back_with_every_token_through_the_cluster(http, tokenizer):
    """Greedy: the chosen token is the most likely one, so its logprob heads the top list."""
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == reply.json()["usage"]["completion_tokens"] == 8
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(max(t["logprob"] for t in entry["top_logprobs"]), abs=1e-6)
    # Streamed: each chunk carries its own tokens' logprobs, together the same as the whole answer.
    streamed = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    completion = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": 2}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4


def test_logprobs_over_grpc_generate_are_the_http_apis(cluster, http):
    """The SDK's `logprobs` (gRPC Generate, sampling.num_logprobs): one per token, the same
    numbers the HTTP API returns for the same greedy request."""
    from splitserve.client import Client, GenerateOptions

    options = GenerateOptions(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    with Client(cluster.gateway_grpc, timeout_s=120) as client:
        result = client.generate("Hello", options)
        streamed = list(client.stream("Hello", options))
    assert len(result.token_ids) == len(result.logprobs) == 6
    for token, record in zip(result.token_ids, result.logprobs):
        assert len(record.top) == 3 and record.top[0] == (token, record.logprob)  # greedy: the most likely
    assert [lp for chunk in streamed for lp in chunk.logprobs] == result.logprobs
    completion = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": 3}).json()
    assert [record.logprob for record in result.logprobs] == pytest.approx(
        completion["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
