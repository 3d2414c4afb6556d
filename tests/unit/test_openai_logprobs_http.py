"""logprobs / top_logprobs through the gateway's HTTP app (issue 37), in vLLM's OpenAI shapes:
completions' {tokens, token_logprobs, top_logprobs, text_offset} and chat's {content: [{token,
logprob, bytes, top_logprobs}]}, whole and streamed (each chunk with its own tokens' logprobs);
what reaches the coordinator; the refusals (ranges, a diffusion model); and the cut at a
stop string dropping the cut tokens' logprobs with them."""

from __future__ import annotations

import json
import math

import pytest

from gateway.coordinator_client import GenerationDelta, OutputAssembler
from gateway.core import GatewayCore
from gateway.tokenization import Tokenization
from splitserve.config import GatewayConfig
from splitserve.core.sampling import TokenLogprobs
from tests.unit.test_openai_compat_http import BOS, HI, MAX_LEN, ByteTokenizer
from gateway_support import call, events

A, B, C = 65, 66, 67
# "AB" then "C": three tokens, each with its logprob and its top 2 (C was sampled outside them).
STEPS = [
    (A, TokenLogprobs(-0.25, ((A, -0.25), (B, -1.5)))),
    (B, TokenLogprobs(-0.5, ((B, -0.5), (C, -2.0)))),
    (C, TokenLogprobs(-3.0, ((A, -0.75), (BOS, -float("inf"))))),
]


class LogprobCoordinator:
    """Streams the three tokens in two deltas (the first token has no text yet), with logprobs
    when the request asked for them."""

    def __init__(self):
        self.submitted = []

    async def generate(self, request, timeout_s=None, trace_context=None):
        self.submitted.append(request.submit_request())
        asked = request.logprobs is not None
        lp = [record for _, record in STEPS] if asked else []
        yield GenerationDelta("", [A], "", len(request.prompt_token_ids), 1, lp[:1])
        yield GenerationDelta("ABC", [B, C], "stop", len(request.prompt_token_ids), 3, lp[1:])

    async def ready(self, timeout_s: float = 1.0, engine_family: str = "") -> tuple[bool, str]:
        return True, ""

    async def close(self) -> None:
        pass


def gateway(**config):
    coordinator = LogprobCoordinator()
    settings = {"model": "/models/demo", "default_max_tokens": 16, "max_tokens_limit": 1000, **config}
    return GatewayCore(GatewayConfig(**settings), Tokenization(ByteTokenizer(), max_model_len=MAX_LEN),
                       coordinator), coordinator


COMPLETION_LOGPROBS = {
    "tokens": ["A", "B", "C"],
    "token_logprobs": [-0.25, -0.5, -3.0],
    # The sampled token first, then the top N (vLLM's order; up to N + 1 entries); -inf as -9999.
    "top_logprobs": [{"A": -0.25, "B": -1.5}, {"B": -0.5, "C": -2.0}, {"C": -3.0, "A": -0.75, "<s>": -9999.0}],
    "text_offset": [0, 1, 2],
}


def test_completions_return_vllms_logprobs_object():
    core, coordinator = gateway()
    reply = call(core, "/v1/completions", {"prompt": "hi", "logprobs": 2})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == "ABC"
    assert choice["logprobs"] == COMPLETION_LOGPROBS
    assert coordinator.submitted[0].sampling.num_logprobs == 2


def test_completions_logprobs_0_give_the_sampled_tokens_only():
    core, _ = gateway()
    choice = call(core, "/v1/completions", {"prompt": "hi", "logprobs": 0}).json()["choices"][0]
    assert choice["logprobs"]["top_logprobs"] == [{"A": -0.25}, {"B": -0.5}, {"C": -3.0}]


def test_without_logprobs_nothing_is_asked_and_logprobs_stay_null():
    core, coordinator = gateway()
    assert call(core, "/v1/completions", {"prompt": "hi"}).json()["choices"][0]["logprobs"] is None
    assert call(core, "/v1/chat/completions", {"messages": HI}).json()["choices"][0]["logprobs"] is None
    assert call(core, "/v1/chat/completions", {"messages": HI, "logprobs": False, "top_logprobs": 0}).json()[
        "choices"][0]["logprobs"] is None
    assert not any(s.sampling.HasField("num_logprobs") for s in coordinator.submitted)


def test_chat_returns_content_logprobs_with_bytes_and_top_logprobs():
    core, coordinator = gateway()
    reply = call(core, "/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 2})
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["A", "B", "C"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5, -3.0]
    assert content[0] == {"token": "A", "logprob": -0.25, "bytes": [65], "top_logprobs": [
        {"token": "A", "logprob": -0.25, "bytes": [65]}, {"token": "B", "logprob": -1.5, "bytes": [66]}]}
    # vLLM's serving_chat: the first top_logprobs entries of the step, the sampled token first.
    assert content[2]["top_logprobs"] == [{"token": "C", "logprob": -3.0, "bytes": [67]},
                                          {"token": "A", "logprob": -0.75, "bytes": [65]}]
    assert coordinator.submitted[0].sampling.num_logprobs == 2


def test_chat_logprobs_without_top_logprobs_asks_for_the_sampled_tokens_only():
    core, coordinator = gateway()
    content = call(core, "/v1/chat/completions", {"messages": HI, "logprobs": True}).json()[
        "choices"][0]["logprobs"]["content"]
    assert [c["top_logprobs"] for c in content] == [[], [], []]
    assert coordinator.submitted[0].sampling.num_logprobs == 0


def test_streamed_completion_chunks_carry_their_own_tokens_logprobs():
    core, _ = gateway()
    reply = call(core, "/v1/completions", {"prompt": "hi", "logprobs": 2, "stream": True})
    chunks = [e for e in events(reply) if e["choices"]]
    # The first token had no text yet: its logprobs ride with the chunk that brings its text.
    assert len(chunks) == 1 and chunks[0]["choices"][0]["logprobs"] == COMPLETION_LOGPROBS


def test_streamed_chat_chunks_carry_their_own_tokens_logprobs():
    core, _ = gateway()
    reply = call(core, "/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 1, "stream": True})
    choices = [e["choices"][0] for e in events(reply)]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""} and choices[0]["logprobs"] is None
    content = [c for c in choices if c["delta"].get("content")]
    assert len(content) == 1
    assert [t["token"] for t in content[0]["logprobs"]["content"]] == ["A", "B", "C"]
    assert [len(t["top_logprobs"]) for t in content[0]["logprobs"]["content"]] == [1, 1, 1]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2, "echo": True, "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": 3}, "logprobs"),
])
def test_bad_logprobs_and_echo_with_logprobs_are_refused_naming_the_field(path, body, param):
    core, coordinator = gateway()
    reply = call(core, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert coordinator.submitted == []


def test_a_diffusion_model_refuses_logprobs():
    from gateway.validation import Limits, completion_request
    from splitserve.errors import InvalidArgument

    limits = Limits(served_model="demo", max_model_len=MAX_LEN, engine_family="diffusion")
    tok = Tokenization(ByteTokenizer(), max_model_len=MAX_LEN)
    with pytest.raises(InvalidArgument) as err:
        completion_request({"prompt": "hi", "logprobs": 1}, tok, limits, "r1")
    assert err.value.param == "logprobs" and "diffusion" in err.value.message


def test_tokens_cut_by_a_stop_string_drop_their_logprobs():
    tok = Tokenization(ByteTokenizer(), max_model_len=MAX_LEN)
    assembler = OutputAssembler(tok.detokenizer([BOS, 104], ["B"]), 2)
    records = [record for _, record in STEPS]
    delta = assembler.feed([A, B, C], "", logprobs=records)
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("A", [A, B], "stop")
    assert delta.logprobs == records[:2]
    assert all(math.isfinite(r.logprob) for r in delta.logprobs)
