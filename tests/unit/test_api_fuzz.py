"""Fuzzing the gateway's request validation (issue 18: bad input never hurts anyone else).

Hypothesis feeds `completion_request`, `chat_request` and `generate_request` arbitrary JSON
values, mutated valid bodies, huge integers, NaN and infinities, lone surrogates (what a JSON
`"\\ud800"` escape decodes to) and nested junk. Each call either returns a GenerationRequest
whose wire messages build and serialize (what the gateway sends next), or raises a
SplitserveError with a 4xx status whose `param` is a real field that its message names, and
whose OpenAI error body renders as UTF-8 JSON. Never any other exception.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.openai_format import error_body
from gateway.tokenization import Tokenization
from gateway.validation import (
    PREDICTED_OUTPUT_LEN_HEADER,
    ChatCompletionBody,
    CompletionBody,
    GenerationRequest,
    Limits,
    chat_request,
    completion_request,
    generate_request,
    session_open_params,
)
from splitserve.errors import SplitserveError
from splitserve.proto import gateway_pb2, types_pb2

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)  # the same examples on every run: a failure is reproducible


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 is BOS; with a chat template when `templated`. Like a real
    tokenizer it cannot encode a lone surrogate (`str.encode` raises)."""

    def __init__(self, templated: bool):
        self.chat_template = "{{ messages }}" if templated else None

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([256] if add_special_tokens else []) + list(text.encode())

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


TOKENIZATIONS = [Tokenization(ByteTokenizer(templated), max_model_len=128, vocab_size=300) for templated in (False, True)]
AUTOREGRESSIVE = Limits(served_model="demo", max_model_len=128, default_max_tokens=16, max_tokens_limit=64)
DIFFUSION = Limits(served_model="demo", max_model_len=128, default_max_tokens=16, max_tokens_limit=64,
                   engine_family="diffusion", mask_token_id=299)

# A field at fault is one of the bodies' fields, the body itself, or a header.
FIELDS = set(CompletionBody.model_fields) | set(ChatCompletionBody.model_fields)
PARAMS = FIELDS | {"body", PREDICTED_OUTPUT_LEN_HEADER, "request_id"}

# --- values

HUGE_INTS = st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
                             10**30, -(10**30), 10**300])
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-300, 1e300, 3.5e38, float("nan"), float("inf"), -float("inf")]))
# Lone surrogates are what json.loads makes of "\ud800"; no tokenizer or protobuf can encode them.
SURROGATE = st.sampled_from(["\ud800", "a\udfffb", "\udc80" * 3])
TEXT = st.one_of(st.text(max_size=20), SURROGATE, st.sampled_from(["", " ", "demo", "text", "\x00", "é" * 300]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HUGE_INTS, FLOATS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)

# Fields given plausible-but-wrong values more often than pure noise would.
FIELD_VALUES = st.one_of(JSON, st.lists(st.integers(-5, 400), max_size=6), st.lists(TEXT, max_size=20),
                         st.dictionaries(st.sampled_from(["include_usage", "type", "x"]), JSON, max_size=2),
                         st.lists(st.fixed_dictionaries({"role": TEXT, "content": JSON}), max_size=3))

VALID_COMPLETION = {"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0.0}
VALID_CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@st.composite
def mutated(draw, base: dict) -> dict:
    """A valid body with fields set to random values, removed, or unknown ones added."""
    body = dict(base)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "set", "set", "delete", "unknown"]))
        if action == "set":
            body[draw(st.sampled_from(sorted(FIELDS)))] = draw(FIELD_VALUES)
        elif action == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(TEXT)] = draw(JSON)
    return body


HEADERS = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["5", "-5", "99999999999999999999999", "1, 2"]))


# --- the contract

def check_outcome(call, sent=()) -> None:
    try:
        req = call()
    except SplitserveError as err:
        assert 400 <= err.http_status < 500, (err.http_status, err.message)
        # A field the client sent and we do not know (a lone surrogate in it) counts as real.
        assert err.param in PARAMS or err.param in sent, (err.param, err.message)
        assert err.param in err.message, (err.param, err.message)
        json.dumps(error_body(err), ensure_ascii=False).encode("utf-8")  # what the HTTP API sends
        return
    assert isinstance(req, GenerationRequest)
    req.submit_request().SerializeToString()  # what the gateway sends the coordinator


def _keys(body) -> set:
    return set(body) if isinstance(body, dict) else set()


def run_all(body) -> None:
    for tok in TOKENIZATIONS:
        for limits in (AUTOREGRESSIVE, DIFFUSION):
            check_outcome(lambda: completion_request(body, tok, limits, "r1"), _keys(body))
            check_outcome(lambda: chat_request(body, tok, limits, "r1"), _keys(body))


@FUZZ
@given(JSON)
def test_arbitrary_json_values(body):
    run_all(body)


@FUZZ
@given(st.one_of(mutated(VALID_COMPLETION), mutated(VALID_CHAT)), HEADERS)
def test_mutated_valid_bodies(body, header):
    for tok in TOKENIZATIONS:
        for limits in (AUTOREGRESSIVE, DIFFUSION):
            check_outcome(lambda: completion_request(body, tok, limits, "r1", header), _keys(body))
            check_outcome(lambda: chat_request(body, tok, limits, "r1", header), _keys(body))


HOSTILE = st.one_of(HUGE_INTS, FLOATS, SURROGATE, st.lists(st.one_of(HUGE_INTS, SURROGATE), min_size=1, max_size=3),
                   st.dictionaries(st.sampled_from(["include_usage", "type", "\ud800"]), st.one_of(SURROGATE, FLOATS),
                                   min_size=1, max_size=2),
                   st.lists(st.fixed_dictionaries({"role": TEXT, "content": st.one_of(SURROGATE, HUGE_INTS)}),
                            min_size=1, max_size=2))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(FIELDS)), HOSTILE, min_size=1, max_size=4))
def test_huge_numbers_non_finite_floats_and_lone_surrogates(extra):
    run_all({**VALID_COMPLETION, **extra})
    run_all({**VALID_CHAT, **extra})


@FUZZ
@given(JSON)
def test_session_open_params(body):
    try:
        session_id, ttl = session_open_params(body)
    except SplitserveError as err:
        assert 400 <= err.http_status < 500 and err.param in {"body", "session_id", "ttl_s"} | set(
            body if isinstance(body, dict) else ())
        json.dumps(error_body(err), ensure_ascii=False).encode("utf-8")
        return
    # What the gateway then puts on the wire (CreateSessionRequest: a string and a uint32).
    assert isinstance(session_id, str)
    session_id.encode("utf-8")  # raises on lone surrogates, which the wire's string cannot carry
    assert 0 <= ttl <= 2**32 - 1


# --- gRPC GenerateRequest: values within the wire types' ranges, and random bytes

U32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 127, 128, 2**31, 2**32 - 1]))
F32 = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 2.0]))


@st.composite
def generate_messages(draw) -> gateway_pb2.GenerateRequest:
    msg = gateway_pb2.GenerateRequest(model=draw(st.sampled_from(["", "demo", "other"])),
                                      session_id=draw(st.text(max_size=300)),
                                      priority=draw(st.integers(-(2**31), 2**31 - 1)),
                                      echo_token_ids=draw(st.booleans()))
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        msg.text = draw(st.text(max_size=150))
    elif prompt == "ids":
        msg.token_ids.ids.extend(draw(st.lists(U32, max_size=140)))
    s = msg.sampling
    for name in ("max_tokens", "steps", "block_length"):
        if draw(st.booleans()):
            setattr(s, name, draw(U32))
    for name in ("temperature", "top_p", "retention_ratio", "cfg_scale"):
        if draw(st.booleans()):
            setattr(s, name, draw(F32))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.top_k = draw(U32)
    s.stop.extend(draw(st.lists(st.text(max_size=5), max_size=18)))
    s.stop_token_ids.extend(draw(st.lists(U32, max_size=3)))
    s.remasking = draw(st.sampled_from(["", "random", "low_confidence", "bogus"]))
    msg.slo.ttft_ms, msg.slo.itl_ms = draw(U32), draw(U32)
    if draw(st.booleans()):
        msg.predicted_output_len = draw(U32)
    return msg


def check_generate(msg: gateway_pb2.GenerateRequest) -> None:
    for tok in TOKENIZATIONS:
        for limits in (AUTOREGRESSIVE, DIFFUSION):
            check_outcome(lambda: generate_request(msg, tok, limits, "r1"))


@FUZZ
@given(generate_messages())
def test_generate_request_fields(msg):
    check_generate(msg)


@FUZZ
@given(st.one_of(st.binary(max_size=200),
                 generate_messages().map(lambda m: m.SerializeToString()).flatmap(
                     lambda raw: st.tuples(st.just(raw), st.integers(0, max(len(raw), 1)), st.binary(max_size=8))
                     .map(lambda t: t[0][:t[1]] + t[2]))))
def test_generate_request_from_random_and_truncated_bytes(raw):
    msg = gateway_pb2.GenerateRequest()
    try:
        msg.ParseFromString(raw)
    except Exception:  # noqa: BLE001 (grpc answers a message that does not parse before our code runs)
        return
    check_generate(msg)


def test_sampling_params_proto_takes_every_validated_value():
    """The edge values the fuzzing found: each is refused naming its field, or fits the wire."""
    tok = TOKENIZATIONS[0]
    for field, value in [("top_k", 2**32), ("top_k", 10**30), ("prompt", "\ud800"), ("stop", ["\udfff"]),
                         ("session_id", "s\ud800"), ("model", "\ud800"), ("user", "\ud800"),
                         ("stop", ["x" * 1025]), ("logit_bias", {"\ud800": 1})]:
        body = {**VALID_COMPLETION, field: value}
        try:
            completion_request(body, tok, AUTOREGRESSIVE, "r1")
        except SplitserveError as err:
            assert err.param == field and err.http_status == 400, (field, err.param, err.message)
            json.dumps(error_body(err), ensure_ascii=False).encode("utf-8")
        else:
            raise AssertionError(f"{field}={value!r} was accepted")
    assert types_pb2.SamplingParams(top_k=2**32 - 1).top_k == 2**32 - 1
    for ttl in (float("nan"), float("inf"), -1, 2**40):
        try:
            session_open_params({"ttl_s": ttl})
        except SplitserveError as err:
            assert err.param == "ttl_s"
        else:
            raise AssertionError(f"ttl_s={ttl} was accepted")
