"""Validation of OpenAI bodies and GenerateRequest protos, and tokenization helpers (fake byte tokenizer)."""

from __future__ import annotations

import json

import pytest

from gateway.tokenization import Tokenization, read_model_limits, render_default_chat
from gateway.validation import (
    Limits,
    chat_request,
    completion_request,
    generate_request,
    invalid_argument_from_pydantic,
)
from splitserve.errors import InvalidArgument, NotFound
from splitserve.proto import gateway_pb2, types_pb2

BOS = 256


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 is BOS; `chat_template` None unless given."""

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        # Stands in for a real template: it writes BOS itself.
        return "<BOS>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


TOK = Tokenization(ByteTokenizer(), max_model_len=64, vocab_size=300)
LIMITS = Limits(served_model="demo", max_model_len=64, default_max_tokens=16, max_tokens_limit=40)


def completion(**body):
    return completion_request(body, TOK, LIMITS, "r1")


def chat(**body):
    return chat_request(body, TOK, LIMITS, "r1")


def bad(fn, body, param, *fragments, cls=InvalidArgument):
    with pytest.raises(cls) as info:
        fn(**body)
    assert info.value.param == param
    for fragment in (param, *fragments):
        assert fragment in info.value.message, info.value.message
    return info.value


# --- completions: every bad input names its field (and the limit it broke)

@pytest.mark.parametrize("body,param,fragments", [
    ({}, "prompt", ["required"]),
    ({"prompt": ""}, "prompt", ["empty"]),
    ({"prompt": []}, "prompt", ["empty"]),
    ({"prompt": [[]]}, "prompt", ["empty"]),
    ({"prompt": 5}, "prompt", ["string"]),
    ({"prompt": [1, "a"]}, "prompt", ["token ids"]),
    ({"prompt": [True]}, "prompt", []),
    ({"prompt": ["a", "b"]}, "prompt", ["batches"]),
    ({"prompt": [1, 300]}, "prompt", ["300", "vocab has 300"]),
    ({"prompt": [-1]}, "prompt", ["-1"]),
    ({"prompt": "x" * 64}, "prompt", ["64", "max_model_len"]),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", [">= 1"]),
    ({"prompt": "hi", "max_tokens": 41}, "max_tokens", ["<= 40"]),
    ({"prompt": "x" * 30, "max_tokens": 35}, "max_tokens", ["max_model_len", "64", "66", "at most 33"]),
    ({"prompt": "hi", "max_tokens": "3"}, "max_tokens", ["integer"]),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens", ["integer"]),
    ({"prompt": "hi", "max_tokens": 3.0}, "max_tokens", ["integer"]),
    ({"prompt": "hi", "temperature": -0.1}, "temperature", ["[0, 2]"]),
    ({"prompt": "hi", "temperature": 2.5}, "temperature", ["[0, 2]"]),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature", []),
    ({"prompt": "hi", "top_p": 0}, "top_p", ["(0, 1]"]),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", ["(0, 1]"]),
    ({"prompt": "hi", "top_k": -2}, "top_k", [">= 0"]),
    ({"prompt": "hi", "n": 17}, "n", ["[1, 16]", "max_n", "17"]),
    ({"prompt": "hi", "n": 0}, "n", ["[1, 16]"]),
    ({"prompt": "hi", "n": 2, "session_id": "s"}, "n", ["session"]),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", [">= 1"]),
    ({"prompt": "hi", "best_of": 3}, "best_of", ["must equal n"]),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of", ["must equal n"]),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", ["[0, 20]", "21"]),
    ({"prompt": "hi", "logprobs": -1}, "logprobs", ["[0, 20]"]),
    ({"prompt": "hi", "logprobs": True}, "logprobs", ["[0, 20]"]),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "session_id": "s"}, "echo", ["session"]),
    ({"prompt": "hi", "suffix": "x"}, "suffix", ["not supported"]),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", ["[-2, 2]", "2.5"]),
    ({"prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty", ["[-2, 2]"]),
    ({"prompt": "hi", "frequency_penalty": float("nan")}, "frequency_penalty", ["[-2, 2]"]),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", ["> 0"]),
    ({"prompt": "hi", "repetition_penalty": -1.5}, "repetition_penalty", ["> 0"]),
    ({"prompt": "hi", "min_p": 1.01}, "min_p", ["[0, 1]"]),
    ({"prompt": "hi", "min_p": -0.1}, "min_p", ["[0, 1]"]),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens", ["[0, 16]"]),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 8}, "min_tokens", ["max_tokens", "[0, 8]", "9"]),
    ({"prompt": "hi", "min_tokens": 1.5}, "min_tokens", []),
    ({"prompt": "hi", "logit_bias": {"1": 5}}, "logit_bias", ["not supported"]),
    ({"prompt": "hi", "seed": -1}, "seed", ["2^63"]),
    ({"prompt": "hi", "seed": 2**63}, "seed", ["2^63"]),
    ({"prompt": "hi", "stop": [""]}, "stop", ["non-empty"]),
    ({"prompt": "hi", "stop": 5}, "stop", ["string"]),
    ({"prompt": "hi", "stop": ["a", 1]}, "stop", ["list of strings"]),
    ({"prompt": "hi", "stop": ["s"] * 17}, "stop", ["at most 16"]),
    ({"prompt": "hi", "stop_token_ids": [400]}, "stop_token_ids", ["400"]),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", ["stream is true"]),
    ({"prompt": "hi", "stream": "yes"}, "stream", ["boolean"]),
    ({"prompt": "hi", "slo_ttft_ms": -5}, "slo_ttft_ms", []),
    ({"prompt": "hi", "priority": 2**40}, "priority", ["32-bit"]),
    ({"prompt": "hi", "session_id": "s" * 300}, "session_id", ["256"]),
])
def test_completion_rejects_bad_input_naming_the_field(body, param, fragments):
    bad(completion, body, param, *fragments)


def test_unknown_model_is_not_found_naming_it():
    err = bad(completion, {"prompt": "hi", "model": "gpt-9"}, "model", "gpt-9", "demo", cls=NotFound)
    assert err.http_status == 404


def test_body_must_be_an_object():
    with pytest.raises(InvalidArgument) as info:
        completion_request([1, 2], TOK, LIMITS, "r1")
    assert info.value.param == "body"


def test_completion_defaults_and_conversions():
    req = completion(prompt="hi", model="demo")
    assert req.prompt_token_ids == [BOS, ord("h"), ord("i")]
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (16, None, None, 0, None)
    assert (req.stream, req.include_usage, req.model, req.request_id) == (False, False, "demo", "r1")
    req = completion(prompt=[[5, 6]], top_k=-1, stop="END", seed=7, stream=True,
                     stream_options={"include_usage": True}, temperature=0, user="u", unknown_field=1)
    assert req.prompt_token_ids == [5, 6]
    assert (req.top_k, req.stop, req.seed, req.include_usage, req.temperature) == (0, ["END"], 7, True, 0)
    assert not req.continuous_usage
    req = completion(prompt="hi", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert req.continuous_usage
    # vLLM sends continuous usage only with include_usage
    assert not completion(prompt="hi", stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage


def test_default_max_tokens_shrinks_to_fit_a_long_prompt():
    req = completion(prompt="x" * 58)  # 59 tokens with BOS; 5 left of 64
    assert req.max_tokens == 5


def test_submit_request_leaves_unset_sampling_options_unset():
    submit = completion(prompt="hi").submit_request()
    assert not submit.sampling.HasField("temperature") and not submit.sampling.HasField("seed")
    assert submit.sampling.max_tokens == 16 and submit.request_id == "r1" and submit.model == "demo"
    greedy = completion(prompt="hi", temperature=0, seed=3, top_p=0.5, slo_ttft_ms=200, session_id="s").submit_request()
    assert greedy.sampling.HasField("temperature") and greedy.sampling.temperature == 0
    assert greedy.sampling.seed == 3 and greedy.sampling.top_p == 0.5
    assert greedy.slo.ttft_ms == 200 and greedy.session_id == "s"


# --- chat

@pytest.mark.parametrize("body,param,fragments", [
    ({}, "messages", ["required"]),
    ({"messages": []}, "messages", ["non-empty"]),
    ({"messages": "hi"}, "messages", []),
    ({"messages": ["hi"]}, "messages", ["messages[0]"]),
    ({"messages": [{"content": "x"}]}, "messages", ["messages[0].role"]),
    ({"messages": [{"role": "user", "content": ""}]}, "messages", ["empty"]),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", ["messages[0].content"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages",
     ["messages[0].content[0]", "image_url"]),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", ["boolean"]),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", ["logprobs must be set"]),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     ["[0, 20]"]),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", ["not supported"]),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
      "json_schema": {"name": "x"}}}, "response_format", ["schema is required"]),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens", [">= 1"]),
    ({"messages": [{"role": "user", "content": "x"}], "n": 17}, "n", ["[1, 16]"]),
])
def test_chat_rejects_bad_input_naming_the_field(body, param, fragments):
    bad(chat, body, param, *fragments)


def test_chat_uses_the_tokenizer_template_without_adding_bos_again():
    tok = Tokenization(ByteTokenizer(chat_template="{{ messages }}"), max_model_len=64, vocab_size=300)
    req = chat_request({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS, "r")
    assert bytes(req.prompt_token_ids).decode() == "<BOS>[user]hi[assistant]"


def test_chat_falls_back_to_the_default_template_with_bos():
    req = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               max_completion_tokens=3, max_tokens=9)
    assert req.prompt_token_ids[0] == BOS
    assert bytes(req.prompt_token_ids[1:]).decode() == "<|system|>\nbe brief\n<|user|>\na\nb\n<|assistant|>\n"
    assert req.max_tokens == 3  # max_completion_tokens wins over max_tokens


def test_default_chat_template_text():
    assert render_default_chat([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"


# --- GenerateRequest protos

def proto(**kw) -> gateway_pb2.GenerateRequest:
    sampling = kw.pop("sampling", {})
    return gateway_pb2.GenerateRequest(sampling=types_pb2.SamplingParams(**sampling), **kw)


@pytest.mark.parametrize("msg,param,fragments", [
    (proto(), "prompt", ["required"]),
    (proto(text=""), "prompt", ["empty"]),
    (proto(token_ids=gateway_pb2.TokenIds()), "prompt", ["empty"]),
    (proto(token_ids=gateway_pb2.TokenIds(ids=[1, 999])), "prompt", ["999"]),
    (proto(text="hi", sampling={"max_tokens": 0}), "max_tokens", [">= 1"]),
    (proto(text="hi", sampling={"max_tokens": 100}), "max_tokens", ["<= 40"]),
    (proto(text="hi", sampling={"top_p": 0.0}), "top_p", ["(0, 1]"]),
    (proto(text="hi", sampling={"temperature": 3.0}), "temperature", ["[0, 2]"]),
    (proto(text="hi", sampling={"seed": 2**63}), "seed", ["2^63"]),
    (proto(text="hi", sampling={"stop": [""]}), "stop", ["non-empty"]),
    (proto(text="hi", sampling={"stop_token_ids": [301]}), "stop_token_ids", ["301"]),
    (proto(text="hi", session_id="s" * 257), "session_id", ["256"]),
])
def test_generate_request_rejects_bad_input_naming_the_field(msg, param, fragments):
    bad(lambda: generate_request(msg, TOK, LIMITS, "r"), {}, param, *fragments)


def test_generate_request_unknown_model():
    with pytest.raises(NotFound):
        generate_request(proto(text="hi", model="other"), TOK, LIMITS, "r")


def test_generate_request_fields():
    req = generate_request(proto(text="hi", sampling={"max_tokens": 4, "temperature": 0.0, "top_k": 5, "stop": ["x"]},
                                 echo_token_ids=True, priority=2, slo=types_pb2.Slo(ttft_ms=100, itl_ms=20),
                                 session_id="s1"), TOK, LIMITS, "r9")
    assert req.prompt_token_ids == [BOS, ord("h"), ord("i")]
    assert (req.max_tokens, req.temperature, req.top_k, req.stop, req.seed) == (4, 0.0, 5, ["x"], None)
    assert (req.echo_token_ids, req.stream, req.include_usage) == (True, True, True)
    assert (req.priority, req.slo_ttft_ms, req.slo_itl_ms, req.session_id, req.request_id) == (2, 100, 20, "s1", "r9")
    ids = generate_request(proto(token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3])), TOK, LIMITS, "r")
    assert ids.prompt_token_ids == [1, 2, 3] and ids.max_tokens == 16


# --- FastAPI/pydantic error formatting

def test_pydantic_errors_become_one_invalid_argument():
    err = invalid_argument_from_pydantic([{"loc": ("body", "max_tokens"), "msg": "Input should be a valid integer",
                                           "type": "int_type"}])
    assert err.param == "max_tokens" and err.message == "max_tokens: Input should be a valid integer"
    err = invalid_argument_from_pydantic([{"loc": ("body", 12), "msg": "JSON decode error", "type": "json_invalid",
                                           "ctx": {"error": "Expecting value"}}])
    assert err.param == "body" and "not valid JSON" in err.message
    err = invalid_argument_from_pydantic([{"loc": ("body", "stream_options", "include_usage"), "msg": "bad",
                                           "type": "bool_type"}])
    assert err.param == "stream_options" and err.message.startswith("stream_options.include_usage")


# --- tokenization

def test_check_token_ids_names_the_position_and_vocab():
    with pytest.raises(InvalidArgument, match=r"stop_token_ids\[1\] = 300 .* 300 ids"):
        TOK.check_token_ids([1, 300], "stop_token_ids")
    assert TOK.check_token_ids((1, 2)) == [1, 2]


def test_vocab_size_falls_back_to_the_tokenizer_length():
    assert Tokenization(ByteTokenizer(), max_model_len=10).vocab_size == 259


def test_read_model_limits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048, "vocab_size": 512,
                                                      "model_type": "llama"}))
    assert read_model_limits(tmp_path) == (2048, 512, "llama")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 99, "vocab_size": 7}}))
    assert read_model_limits(tmp_path) == (99, 7, "")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="max length"):
        read_model_limits(tmp_path)


# --- the output-length hint: body field, x-predicted-output-len header, GenerateRequest field

HINT_HEADER = "x-predicted-output-len"


def completion_with_header(header: str | None, **body):
    return completion_request(body, TOK, LIMITS, "r1", header)


@pytest.mark.parametrize("body,header,param,fragments", [
    ({"predicted_output_len": -1}, None, "predicted_output_len", ["[0, 4294967295]", "-1"]),
    ({"predicted_output_len": 2**32}, None, "predicted_output_len", ["4294967296"]),
    ({"predicted_output_len": "12"}, None, "predicted_output_len", ["integer"]),
    ({"predicted_output_len": 12.0}, None, "predicted_output_len", ["integer"]),
    ({"predicted_output_len": True}, None, "predicted_output_len", ["integer"]),
    ({}, "-5", HINT_HEADER, ["negative", "'-5'"]),
    ({}, "abc", HINT_HEADER, ["not an integer", "'abc'"]),
    ({}, "", HINT_HEADER, ["not an integer"]),
    ({}, "1.5", HINT_HEADER, ["not an integer"]),
    ({}, "1e3", HINT_HEADER, ["not an integer"]),
    ({}, "+5", HINT_HEADER, ["not an integer"]),
    ({}, "1_000", HINT_HEADER, ["not an integer"]),
    ({}, "5, 6", HINT_HEADER, ["several values"]),  # a repeated header, comma-joined
    ({}, "٣", HINT_HEADER, ["not an integer"]),  # a non-ASCII digit
    ({}, "4294967296", HINT_HEADER, ["[0, 4294967295]"]),
    ({}, "9" * 5000, HINT_HEADER, ["..."]),  # shown shortened, refused without converting it
    ({"predicted_output_len": 10}, "x", HINT_HEADER, []),  # the body wins, yet a bad header is still refused
])
def test_bad_hint_is_refused_naming_the_body_field_or_the_header(body, header, param, fragments):
    bad(lambda: completion_with_header(header, prompt="hi", **body), {}, param, *fragments)
    bad(lambda: chat_request({"messages": [{"role": "user", "content": "hi"}], **body}, TOK, LIMITS, "r1", header),
        {}, param, *fragments)


def test_hint_absent_zero_given_clamped_and_the_body_wins():
    absent = completion(prompt="hi")
    assert absent.predicted_output_len is None
    assert not absent.submit_request().HasField("predicted_output_len")  # absent stays absent downstream
    zero = completion(prompt="hi", predicted_output_len=0).submit_request()
    assert zero.HasField("predicted_output_len") and zero.predicted_output_len == 0  # 0 is a hint, not "none"
    assert completion(prompt="hi", max_tokens=30, predicted_output_len=12).submit_request().predicted_output_len == 12
    # Above max_tokens it is clamped: the request can generate no more (the default budget included).
    assert completion(prompt="hi", max_tokens=8, predicted_output_len=2**32 - 1).predicted_output_len == 8
    assert completion(prompt="hi", predicted_output_len=500).predicted_output_len == 16
    assert completion_with_header(" 25 ", prompt="hi", max_tokens=30).predicted_output_len == 25
    assert completion_with_header("25", prompt="hi", max_tokens=30, predicted_output_len=7).predicted_output_len == 7
    chat_req = chat_request({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20},
                            TOK, LIMITS, "r1", "300")
    assert chat_req.predicted_output_len == 20


def test_generate_request_hint_is_optional_and_clamped():
    assert generate_request(proto(text="hi"), TOK, LIMITS, "r").predicted_output_len is None
    zero = generate_request(proto(text="hi", predicted_output_len=0), TOK, LIMITS, "r")
    assert zero.predicted_output_len == 0 and zero.submit_request().HasField("predicted_output_len")
    hinted = generate_request(proto(text="hi", sampling={"max_tokens": 30}, predicted_output_len=12), TOK, LIMITS, "r")
    assert hinted.submit_request().predicted_output_len == 12
    big = generate_request(proto(text="hi", sampling={"max_tokens": 30}, predicted_output_len=2**32 - 1), TOK,
                           LIMITS, "r")
    assert big.predicted_output_len == 30
