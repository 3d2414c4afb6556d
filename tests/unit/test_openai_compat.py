"""The OpenAI API as clients use it (issue 37), pure: the max_tokens defaults, fields this server
does not implement refused by name (never silently ignored), unknown fields ignored as vLLM
does, context_length_exceeded, the chat template options and /tokenize, /detokenize bodies.

A fake byte tokenizer; the HTTP side of the same features is in test_openai_compat_http.py.
"""

from __future__ import annotations

import pytest

from gateway.openai_format import error_body
from gateway.tokenization import Tokenization, render_default_chat
from gateway.validation import (
    HARMLESS_FIELDS,
    NOT_IMPLEMENTED,
    NOT_IMPLEMENTED_CHAT,
    ContextLengthExceeded,
    Limits,
    chat_request,
    completion_request,
    detokenize_request,
    generate_request,
    tokenize_request,
)
from splitserve.errors import InvalidArgument, NotFound
from splitserve.proto import gateway_pb2

BOS = 256


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 is BOS; a chat template that writes BOS itself when `templated`."""

    def __init__(self, templated: bool = False):
        self.chat_template = "{{ messages }}" if templated else None
        self.template_calls: list[dict] = []

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return text if skip_special_tokens else "".join("<s>" if i == BOS else "" for i in ids[:1]) + text

    def convert_ids_to_tokens(self, ids):
        return ["<s>" if i == BOS else chr(i) for i in ids]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs) -> str:
        self.template_calls.append({"add_generation_prompt": add_generation_prompt, **kwargs})
        body = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        if kwargs.get("continue_final_message"):
            return "<BOS>" + body
        return "<BOS>" + body + ("[assistant]" if add_generation_prompt else "")


MAX_LEN = 64
TOK = Tokenization(ByteTokenizer(), max_model_len=MAX_LEN, vocab_size=300)
LIMITS = Limits(served_model="demo", max_model_len=MAX_LEN, default_max_tokens=16, max_tokens_limit=40)
WIDE = Limits(served_model="demo", max_model_len=MAX_LEN, default_max_tokens=16, max_tokens_limit=1000)
DIFFUSION = Limits(served_model="demo", max_model_len=MAX_LEN, default_max_tokens=16, max_tokens_limit=40,
                   engine_family="diffusion")
HI = [{"role": "user", "content": "hi"}]


def chat(limits=LIMITS, tok=TOK, **body):
    return chat_request({"messages": HI, **body}, tok, limits, "r1")


def completion(limits=LIMITS, **body):
    return completion_request({"prompt": "hi", **body}, TOK, limits, "r1")


# --- max_tokens defaults: chat the rest of the context, legacy completions 16 (as vLLM)

def test_chat_defaults_to_the_rest_of_the_context():
    prompt_len = len(chat(WIDE).prompt_token_ids)  # BOS + "<|user|>\nhi\n<|assistant|>\n"
    assert chat(WIDE).max_tokens == MAX_LEN - prompt_len
    assert chat(WIDE).submit_request().sampling.max_tokens == MAX_LEN - prompt_len


def test_chat_default_stays_within_the_servers_max_tokens_limit():
    # 27 prompt tokens leave 37; --max-tokens-limit 20 caps the default (an explicit 21 is refused).
    capped = Limits(served_model="demo", max_model_len=MAX_LEN, default_max_tokens=16, max_tokens_limit=20)
    assert chat(capped).max_tokens == 20
    assert chat(LIMITS).max_tokens == MAX_LEN - 27 == 37  # below the limit of 40: the rest of the context


def test_only_chat_on_an_autoregressive_model_defaults_to_the_rest_of_the_context():
    rest = MAX_LEN - 27
    assert chat(WIDE).max_tokens == rest
    # Legacy completions keep vLLM's (and OpenAI's) 16, shortened to fit a long prompt, not refused.
    assert (completion(WIDE).max_tokens, completion(WIDE, prompt="x" * 58).max_tokens) == (16, 5)
    # gRPC Generate keeps the configured default: it is no OpenAI API.
    assert generate_request(gateway_pb2.GenerateRequest(text="hi"), TOK, WIDE, "r").max_tokens == 16
    # A diffusion model's output length is a fixed canvas, not a cap: "the rest of the context"
    # would generate all of it, so its chat keeps the configured default.
    assert chat(DIFFUSION).max_tokens == 16
    # An explicit value is what it says.
    assert (chat(WIDE, max_tokens=7).max_tokens, chat(WIDE, max_completion_tokens=9).max_tokens) == (7, 9)


# --- fields this server does not implement: refused naming the field; their defaults accepted

# A value that asks for the behaviour, per field in the tables (a new entry needs one here).
ASKING = {
    "use_beam_search": True, "length_penalty": 0.8,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "logits_processors": ["mod.fn"], "watermarking": True,
    "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 100,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "prompt_logprobs": 1, "logprob_token_ids": [3], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "truncate_prompt_tokens": 10, "truncation_side": "left", "prompt_embeds": "AAAA",
    "structural_tag": "{}", "guided_whitespace_pattern": " ",
    "request_id": "mine", "cache_salt": "salt", "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {}, "vllm_xargs": {"a": 1},
    # chat only
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}", "mm_processor_kwargs": {},
    "media_io_kwargs": {}, "reasoning_effort": "low", "include_reasoning": False, "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": {"name": "f"}, "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "web_search_options": {},
}
DEFAULTS = {name: accepted for table in (NOT_IMPLEMENTED, NOT_IMPLEMENTED_CHAT)
            for name, (accepted, _) in table.items()}


def test_every_refused_field_has_a_test_value():
    assert set(ASKING) == set(NOT_IMPLEMENTED) | set(NOT_IMPLEMENTED_CHAT)


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED))
def test_a_vllm_field_we_do_not_implement_is_refused_on_both_endpoints(name):
    for call in (completion, chat):
        with pytest.raises(InvalidArgument) as info:
            call(**{name: ASKING[name]})
        assert info.value.param == name and name in info.value.message and "not supported" in info.value.message
        assert error_body(info.value)["error"]["param"] == name


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED_CHAT))
def test_a_chat_field_we_do_not_implement_is_refused(name):
    with pytest.raises(InvalidArgument) as info:
        chat(**{name: ASKING[name]})
    assert info.value.param == name and name in info.value.message


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_a_refused_fields_default_values_are_accepted(name):
    for value in DEFAULTS[name]:
        req = chat(**{name: value})
        assert req.ignored_fields == ()
        if name in NOT_IMPLEMENTED:
            completion(**{name: value})


def test_a_json_true_is_not_the_default_1_nor_0_false():
    for name, value in (("repetition_penalty", True), ("min_tokens", False), ("min_p", False),
                        ("include_stop_str_in_output", 0)):
        with pytest.raises(InvalidArgument, match=name):
            completion(**{name: value})


# --- vLLM's penalties and filters: accepted on every API and carried to the engine

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.5, "min_p": 0.25,
             "min_tokens": 3}


def test_penalties_min_p_and_min_tokens_reach_the_sampling_params_on_both_endpoints():
    for call in (completion, chat):
        sampling = call(**PENALTIES).submit_request().sampling
        assert {name: getattr(sampling, name) for name in PENALTIES} == PENALTIES
    # Unsent or at their defaults, they stay unset on the wire: the engine's no-op defaults apply.
    plain = completion(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, min_p=0,
                       min_tokens=0).submit_request().sampling
    assert not any(plain.HasField(name) for name in ("presence_penalty", "frequency_penalty",
                                                     "repetition_penalty", "min_p"))
    assert plain.min_tokens == 0


def test_grpc_generate_takes_the_penalties_and_checks_their_ranges():
    from splitserve.proto import types_pb2

    def generate(**sampling):
        msg = gateway_pb2.GenerateRequest(text="hi", sampling=types_pb2.SamplingParams(max_tokens=8, **sampling))
        return generate_request(msg, TOK, LIMITS, "r")

    sampling = generate(**PENALTIES).submit_request().sampling
    assert {name: getattr(sampling, name) for name in PENALTIES} == PENALTIES
    for field, value, limit in (("presence_penalty", -2.5, "[-2, 2]"), ("frequency_penalty", 3.0, "[-2, 2]"),
                                ("repetition_penalty", 0.0, "> 0"), ("min_p", 1.5, "[0, 1]"),
                                ("min_tokens", 9, "[0, 8]")):
        with pytest.raises(InvalidArgument) as info:
            generate(**{field: value})
        assert info.value.param == field and field in info.value.message and limit in info.value.message


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_a_diffusion_model_refuses_the_penalties_naming_them(name):
    with pytest.raises(InvalidArgument) as info:
        completion(DIFFUSION, **{name: PENALTIES[name]})
    assert info.value.param == name and "diffusion" in info.value.message


def test_chat_echo_is_vllms_last_message_in_the_replys_role():
    assert chat(echo=False).ignored_fields == () and not chat(echo=False).echo
    # The last message is the user's: the assistant's reply echoes nothing of it.
    assert chat(echo=True).echo and chat(echo=True).echo_text == ""


def test_completions_take_a_structured_response_format_too():
    assert completion(response_format={"type": "json_object"}).structured_output.kind == "json_object"
    assert completion(response_format={"type": "text"}).structured_output is None


def test_unknown_fields_are_ignored_and_reported_harmless_ones_quietly():
    req = chat(some_vendor_knob=3, zz_top=True, store=False, metadata={"a": "b"}, parallel_tool_calls=True,
               stream_interval=4, prediction={"type": "content", "content": "x"}, user="u")
    assert req.ignored_fields == ("some_vendor_knob", "zz_top")
    assert set(HARMLESS_FIELDS) == {"store", "metadata", "service_tier", "prediction", "parallel_tool_calls",
                                    "stream_interval"}
    many = completion(**{f"field_{i:02d}_" + "x" * 100: i for i in range(40)})
    assert len(many.ignored_fields) == 16 and all(len(name) == 64 for name in many.ignored_fields)


# --- context_length_exceeded

def test_a_chat_prompt_longer_than_the_context_is_context_length_exceeded():
    long = [{"role": "user", "content": "x" * 80}]
    with pytest.raises(ContextLengthExceeded) as info:
        chat_request({"messages": long}, TOK, LIMITS, "r1")
    err = info.value
    assert (err.param, err.http_status) == ("messages", 400)
    assert err.message.startswith(f"This model's maximum context length is {MAX_LEN} tokens")
    assert "your messages resulted in 105 tokens" in err.message
    assert error_body(err)["error"] == {"message": err.message, "type": "invalid_request_error", "param": "messages",
                                        "code": "context_length_exceeded"}


def test_the_message_counts_prompt_and_completion_when_max_tokens_is_given():
    with pytest.raises(ContextLengthExceeded) as info:
        completion_request({"prompt": "x" * 70, "max_tokens": 5}, TOK, LIMITS, "r1")
    assert info.value.param == "prompt"
    assert ("However, you requested 76 tokens (71 in the prompt, 5 in the completion). Please reduce the length "
            "of the prompt or completion.") in info.value.message


def test_max_tokens_that_does_not_fit_beside_the_prompt_names_max_tokens():
    with pytest.raises(ContextLengthExceeded) as info:
        chat(max_completion_tokens=40, messages=[{"role": "user", "content": "x" * 30}])
    err = info.value
    assert err.param == "max_completion_tokens"
    assert "(55 in the messages, 40 in the completion)" in err.message and "at most 9" in err.message
    assert error_body(err)["error"]["code"] == "context_length_exceeded"


def test_grpc_prompt_too_long_is_context_length_exceeded_naming_prompt():
    with pytest.raises(ContextLengthExceeded) as info:
        generate_request(gateway_pb2.GenerateRequest(text="x" * 70), TOK, LIMITS, "r")
    assert info.value.param == "prompt" and info.value.status == "INVALID_ARGUMENT"


# --- chat template options (vLLM's add_generation_prompt, continue_final_message, ...)

def text_of(ids):
    return bytes(i for i in ids if i < 256).decode()


def test_add_generation_prompt_false_leaves_out_the_assistant_opener():
    req = chat(add_generation_prompt=False)
    assert req.prompt_token_ids[0] == BOS and text_of(req.prompt_token_ids) == "<|user|>\nhi\n"
    assert render_default_chat(HI, add_generation_prompt=False) == "<|user|>\nhi\n"


def test_continue_final_message_leaves_the_assistants_message_open():
    messages = [*HI, {"role": "assistant", "content": "Paris is"}]
    req = chat_request({"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
                       TOK, WIDE, "r1")
    assert text_of(req.prompt_token_ids) == "<|user|>\nhi\n<|assistant|>\nParis is"
    tok = Tokenization(ByteTokenizer(templated=True), max_model_len=MAX_LEN, vocab_size=300)
    req = chat_request({"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
                       tok, WIDE, "r1")
    assert text_of(req.prompt_token_ids) == "<BOS>[user]hi[assistant]Paris is"
    assert tok.tokenizer.template_calls[-1] == {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize("body,fragment", [
    ({"continue_final_message": True}, "add_generation_prompt"),  # it defaults to true, as in vLLM
    ({"continue_final_message": True, "add_generation_prompt": False}, "last message"),  # last is the user's
])
def test_continue_final_message_needs_an_open_assistant_turn(body, fragment):
    with pytest.raises(InvalidArgument) as info:
        chat(**body)
    assert info.value.param == "continue_final_message" and fragment in info.value.message


def test_add_special_tokens_on_both_endpoints():
    assert completion(add_special_tokens=False).prompt_token_ids == list(b"hi")
    assert chat(add_special_tokens=False).prompt_token_ids[0] != BOS
    tok = Tokenization(ByteTokenizer(templated=True), max_model_len=MAX_LEN, vocab_size=300)
    assert chat(tok=tok).prompt_token_ids[0] != BOS  # the template writes its own
    assert chat(tok=tok, add_special_tokens=True).prompt_token_ids[0] == BOS


def test_chat_template_kwargs_reach_the_template_and_cannot_override_its_parameters():
    tok = Tokenization(ByteTokenizer(templated=True), max_model_len=MAX_LEN, vocab_size=300)
    chat(tok=tok, chat_template_kwargs={"enable_thinking": False})
    assert tok.tokenizer.template_calls[-1] == {"add_generation_prompt": True, "enable_thinking": False}
    for key in ("add_generation_prompt", "tokenize", "chat_template"):
        with pytest.raises(InvalidArgument) as info:
            chat(tok=tok, chat_template_kwargs={key: True})
        assert info.value.param == "chat_template_kwargs" and key in info.value.message


# --- /tokenize and /detokenize bodies

def test_tokenize_a_prompt_or_messages_as_generation_would():
    assert tokenize_request({"prompt": "hi"}, TOK, LIMITS) == ([BOS, *b"hi"], False)
    assert tokenize_request({"prompt": "hi", "add_special_tokens": False, "return_token_strs": True}, TOK,
                            LIMITS) == (list(b"hi"), True)
    ids, _ = tokenize_request({"messages": HI, "model": "demo"}, TOK, LIMITS)
    assert ids == chat(WIDE).prompt_token_ids
    ids, _ = tokenize_request({"messages": HI, "add_generation_prompt": False}, TOK, LIMITS)
    assert text_of(ids) == "<|user|>\nhi\n"
    # No length check: it says how long a prompt is, however long.
    assert len(tokenize_request({"prompt": "x" * 500}, TOK, LIMITS)[0]) == 501


@pytest.mark.parametrize("body,param,cls", [
    ({}, "prompt", InvalidArgument),
    ({"prompt": "a", "messages": HI}, "prompt", InvalidArgument),
    ({"prompt": 5}, "prompt", InvalidArgument),
    ({"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt", InvalidArgument),
    ({"messages": []}, "messages", InvalidArgument),
    ({"messages": HI, "chat_template": "x"}, "chat_template", InvalidArgument),
    ({"messages": HI, "tools": [{}]}, "tools", InvalidArgument),
    ({"prompt": "a", "model": "other"}, "model", NotFound),
])
def test_tokenize_refuses_bad_bodies_naming_the_field(body, param, cls):
    with pytest.raises(cls) as info:
        tokenize_request(body, TOK, LIMITS)
    assert info.value.param == param


def test_detokenize_checks_ids_against_the_vocab():
    assert detokenize_request({"tokens": [104, 105]}, TOK, LIMITS) == [104, 105]
    assert detokenize_request({"tokens": []}, TOK, LIMITS) == []
    for body, param in (({"tokens": [1, 300]}, "tokens"), ({}, "tokens"), ({"tokens": "hi"}, "tokens"),
                        ({"tokens": [1], "model": "x"}, "model")):
        with pytest.raises((InvalidArgument, NotFound)) as info:
            detokenize_request(body, TOK, LIMITS)
        assert info.value.param == param
    assert TOK.decode([BOS, 104, 105]) == "<s>hi" and TOK.token_strings([BOS, 104]) == ["<s>", "h"]
