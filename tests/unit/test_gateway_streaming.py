"""Output assembly (detokenize, cut at stop strings) and OpenAI response / SSE chunk shaping."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.coordinator_client import GenerationDelta, OutputAssembler
from gateway.http_api import _sse_events, error_response
from gateway.openai_format import SSE_DONE, ResponseShaper, error_body, models_response, sse_event
from splitserve.errors import InvalidArgument, NotFound, Overloaded, Unauthenticated, Unavailable
from splitserve.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def assembler(stop=()):
    return OutputAssembler(IncrementalDetokenizer(ByteTokenizer(), [256, 104, 105], list(stop)), prompt_len=3)


def ids(text: str) -> list[int]:
    return list(text.encode())


# --- OutputAssembler

def test_relays_deltas_and_finishes_with_the_upstream_reason():
    a = assembler()
    first = a.feed(ids("Hel"), "")
    assert (first.text, first.token_ids, first.finish_reason, first.completion_tokens) == ("Hel", ids("Hel"), "", 3)
    last = a.feed(ids("lo"), "length", num_prompt_tokens=7)
    assert (last.text, last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("lo", "length", 7, 5)
    assert a.finished


def test_stop_string_cuts_text_mid_chunk_and_counts_only_consumed_tokens():
    a = assembler(stop=["STOP"])
    d1 = a.feed(ids("ab ST"), "")
    # The detokenizer holds back len("STOP") - 1 characters: they may start the stop string.
    assert d1.text == "ab" and not a.finished
    d2 = a.feed(ids("OP and more"), "")
    assert (d1.text + d2.text, d2.finish_reason, a.finished) == ("ab ", "stop", True)
    assert d2.token_ids == ids("OP") and d2.completion_tokens == 7


def test_held_back_text_is_flushed_when_the_stream_ends():
    a = assembler(stop=["STOP"])
    assert a.feed(ids("wxyz"), "").text == "w"
    assert a.feed([], "length").text == "xyz"


def test_stop_string_wins_over_the_upstream_finish_reason():
    a = assembler(stop=["."])
    assert a.feed(ids("end. x"), "length").finish_reason == "stop"


def test_partial_utf8_waits_for_the_next_token_and_stage_end_does_not_finish():
    a = assembler()
    euro = ids("€")
    d = a.feed(euro[:1], "stage_end")
    assert (d.text, d.token_ids, d.finish_reason, a.finished) == ("", euro[:1], "", False)
    assert a.feed(euro[1:], "").text == "€"
    assert a.feed([], "") is None  # nothing new, nothing to send


# --- response shapes

def shaper(chat: bool, include_usage: bool = False, continuous_usage: bool = False) -> ResponseShaper:
    return ResponseShaper(chat=chat, request_id="abc", model="demo", created=123, include_usage=include_usage,
                          continuous_usage=continuous_usage)


def test_completion_response_shape():
    body = shaper(False).response("hi", "length", 3, 2)
    assert body == {"id": "cmpl-abc", "object": "text_completion", "created": 123, "model": "demo",
                    "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_chat_response_shape():
    body = shaper(True).response("hi", "stop", 3, 2)
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 5


def test_chat_chunks_open_with_the_role_and_split_the_finish():
    s = shaper(True)
    first = s.chunks("He", None)
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "He"}]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in first)
    last = s.chunks("y", "stop")
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in last] == [
        ({"content": "y"}, None), ({}, "stop")]
    assert s.chunks("", None) == []


def test_completion_chunks_and_usage_chunk():
    s = shaper(False, include_usage=True)
    (chunk,) = s.chunks("x", "length")
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert chunk["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}]
    usage = s.usage_chunk(3, 1)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_puts_the_usage_so_far_on_every_chunk_and_counts_tokens_without_text(chat):
    s = shaper(chat, include_usage=True, continuous_usage=True)
    first = s.chunks("He", None, 3, 1, 1)
    assert first[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    if chat:  # the role chunk goes before the first token, as vLLM's
        assert first[0]["usage"]["completion_tokens"] == 0 and len(first) == 2
    # A token whose text is not complete yet (half a UTF-8 character) is still a chunk: the client
    # counts it when it arrives.
    (pending,) = s.chunks("", None, 3, 2, 1)
    assert pending["usage"]["completion_tokens"] == 2
    assert (pending["choices"][0]["delta"] if chat else pending["choices"][0]["text"]) in ({"content": ""}, "")
    assert s.chunks("", None, 3, 2, 0) == []  # nothing new: nothing sent
    last = s.chunks("€", "length", 3, 3, 1)
    assert [c["usage"]["completion_tokens"] for c in last] == [3] * len(last)
    assert s.usage_chunk(3, 3)["usage"]["completion_tokens"] == 3


def test_continuous_usage_needs_include_usage():
    s = shaper(False, include_usage=False, continuous_usage=True)
    assert s.chunks("", None, 3, 1, 1) == []
    assert "usage" not in s.chunks("a", None, 3, 2, 1)[0]


def test_sse_framing():
    event = sse_event({"a": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {"a": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_models_response():
    body = models_response("demo", 5, 2048)
    assert body["object"] == "list" and body["data"][0]["id"] == "demo" and body["data"][0]["max_model_len"] == 2048


# --- errors

def test_error_bodies_are_openai_shaped():
    assert error_body(InvalidArgument("top_p must be in (0, 1]", param="top_p")) == {"error": {
        "message": "top_p must be in (0, 1]", "type": "invalid_request_error", "param": "top_p",
        "code": "invalid_argument"}}
    assert error_body(NotFound("no such model", param="model"))["error"]["code"] == "model_not_found"
    assert error_body(Unauthenticated("bad key"))["error"]["type"] == "authentication_error"
    overloaded = error_body(Overloaded("busy", retry_after_s=2.5))["error"]
    assert (overloaded["type"], overloaded["code"]) == ("rate_limit_error", "rate_limit_exceeded")


def test_error_response_status_and_retry_after():
    response = error_response(Overloaded("busy", retry_after_s=2.1))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert error_response(Unavailable("down")).status_code == 503
    assert "retry-after" not in error_response(InvalidArgument("x", param="n")).headers


# --- the SSE event stream

async def deltas(*items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def collect_events(first, rest, include_usage=False, chat=False):
    async def indexed(items):  # one choice (index 0), as http_api's merge yields it
        async for item in items:
            yield 0, item

    async def go():
        return [e async for e in _sse_events((0, first), indexed(rest), [shaper(chat, include_usage)])]

    events = asyncio.run(go())
    assert events[-1] == SSE_DONE
    return [json.loads(e[6:]) for e in events[:-1]]


def test_sse_stream_ends_with_usage_then_done():
    events = collect_events(GenerationDelta("a", [97], "", 3, 1),
                            deltas(GenerationDelta("b", [98], "length", 3, 2)), include_usage=True)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[1]["choices"][0]["finish_reason"] == "length"
    assert events[2]["choices"] == [] and events[2]["usage"]["completion_tokens"] == 2


def test_sse_stream_reports_a_mid_stream_error_as_an_event():
    events = collect_events(GenerationDelta("a", [97], "", 3, 1), deltas(Unavailable("worker lost")), chat=True)
    assert events[-1] == {"error": {"message": "worker lost", "type": "server_error", "param": None,
                                    "code": "unavailable"}}
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_sse_stream_single_final_delta():
    events = collect_events(GenerationDelta("", [], "stop", 3, 0), deltas())
    assert [e["choices"][0]["finish_reason"] for e in events] == ["stop"]
