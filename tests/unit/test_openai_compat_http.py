"""The OpenAI / vLLM API pieces of issue 37 through the gateway's HTTP app (in process over an
ASGI transport, a fake coordinator that records what reaches it): /tokenize, /detokenize,
/version, the chat max_tokens default, refused fields and context_length_exceeded as HTTP 400s
with OpenAI error bodies, and unknown fields logged as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.coordinator_client import GenerationDelta
from gateway.core import GatewayCore
from gateway.http_api import create_app
from gateway.tokenization import Tokenization
from splitserve.config import GatewayConfig

BOS = 256
MAX_LEN = 128


class ByteTokenizer:
    chat_template = None

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if i >= 256 and skip_special_tokens else "<s>" if i >= 256 else chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return ["<s>" if i == BOS else chr(i) for i in ids]


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


def gateway(**config):
    coordinator = RecordingCoordinator()
    settings = {"model": "/models/demo", "default_max_tokens": 16, "max_tokens_limit": 1000, **config}
    return GatewayCore(GatewayConfig(**settings), Tokenization(ByteTokenizer(), max_model_len=MAX_LEN),
                       coordinator), coordinator


def call(core: GatewayCore, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=create_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.request(method, path, json=body, headers=headers)
    return asyncio.run(run())


HI = [{"role": "user", "content": "hi"}]
CHAT_PROMPT = [BOS, *b"<|user|>\nhi\n<|assistant|>\n"]


def test_chat_without_max_tokens_asks_for_the_rest_of_the_context_and_completions_for_16():
    core, coordinator = gateway()
    assert call(core, "POST", "/v1/chat/completions", {"messages": HI}).status_code == 200
    assert call(core, "POST", "/v1/completions", {"prompt": "hi"}).status_code == 200
    assert [s.sampling.max_tokens for s in coordinator.submitted] == [MAX_LEN - len(CHAT_PROMPT), 16]


def test_penalties_min_p_and_min_tokens_are_served_and_reach_the_coordinator():
    fields = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.5, "min_p": 0.125,
              "min_tokens": 2}
    core, coordinator = gateway()
    assert call(core, "POST", "/v1/chat/completions", {"messages": HI, **fields}).status_code == 200
    assert call(core, "POST", "/v1/completions", {"prompt": "hi", **fields}).status_code == 200
    for submitted in coordinator.submitted:
        assert {name: getattr(submitted.sampling, name) for name in fields} == fields
    reply = call(core, "POST", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "presence_penalty"
    assert "[-2, 2]" in reply.json()["error"]["message"]


def test_tokenize_answers_vllms_shape_for_a_prompt_and_for_messages():
    core, coordinator = gateway()
    reply = call(core, "POST", "/tokenize", {"prompt": "hi"})
    assert reply.status_code == 200
    assert reply.json() == {"count": 3, "max_model_len": MAX_LEN, "tokens": [BOS, 104, 105], "token_strs": None}
    reply = call(core, "POST", "/tokenize", {"model": "demo", "messages": HI, "return_token_strs": True})
    body = reply.json()
    assert (body["tokens"], body["count"]) == (CHAT_PROMPT, len(CHAT_PROMPT))
    assert body["token_strs"][:3] == ["<s>", "<", "|"]
    assert call(core, "POST", "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()["tokens"] == [104, 105]
    assert coordinator.submitted == []  # the tokenizer answers; nothing is generated


def test_detokenize_answers_the_text_special_tokens_included():
    core, _ = gateway()
    reply = call(core, "POST", "/detokenize", {"tokens": [BOS, 104, 105]})
    assert (reply.status_code, reply.json()) == (200, {"prompt": "<s>hi"})


def test_version_names_the_installed_splitserve():
    import importlib.metadata

    core, _ = gateway()
    reply = call(core, "GET", "/version")
    assert (reply.status_code, reply.json()) == (200, {"version": importlib.metadata.version("splitserve")})


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": HI, "chat_template": "{{ x }}"}, "chat_template"),
    ("/detokenize", {"tokens": [1, 999]}, "tokens"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_bodies_with_openai_errors(path, body, param):
    core, _ = gateway()
    reply = call(core, "POST", path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error") and param in error["message"]


def test_tokenizer_endpoints_sit_behind_the_api_keys_and_version_does_not():
    core, _ = gateway(api_keys=["sk-test"])
    assert call(core, "POST", "/tokenize", {"prompt": "hi"}).status_code == 401
    assert call(core, "POST", "/detokenize", {"tokens": [104]}).status_code == 401
    assert call(core, "POST", "/tokenize", {"prompt": "hi"}, {"authorization": "Bearer sk-test"}).status_code == 200
    assert call(core, "GET", "/version").status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": HI, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {"prompt": "hi", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "hi", "structural_tag": "{}"}, "structural_tag"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "structural_tag"}}, "response_format"),
])
def test_a_field_we_do_not_implement_is_a_400_naming_it_and_never_reaches_the_coordinator(path, body, param):
    core, coordinator = gateway()
    reply = call(core, "POST", path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_argument")
    assert param in error["message"] and "not supported" in error["message"]
    assert coordinator.submitted == []


@pytest.mark.parametrize("path,body,param,counts", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]}, "messages",
     "your messages resulted in 225 tokens"),
    ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 4}, "prompt",
     "you requested 205 tokens (201 in the prompt, 4 in the completion)"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 120}, "max_tokens",
     "you requested 147 tokens (27 in the messages, 120 in the completion)"),
])
def test_a_prompt_too_long_is_a_400_context_length_exceeded(path, body, param, counts):
    core, coordinator = gateway()
    reply = call(core, "POST", path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", param, "invalid_request_error")
    assert error["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens")
    assert counts in error["message"]
    assert coordinator.submitted == []


def test_unknown_fields_are_served_and_logged_as_ignored(caplog):
    core, coordinator = gateway()
    with caplog.at_level(logging.WARNING, logger="gateway.http_api"):
        reply = call(core, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "frobnicate": 1,
                                                            "store": False})
    assert reply.status_code == 200 and len(coordinator.submitted) == 1
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == ["The following fields were present in the request but ignored: ['frobnicate']"]
