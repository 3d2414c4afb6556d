"""Structured output's pure parts (issue 37): OpenAI's response_format, vLLM's structured_outputs
and guided_* fields turned into one StructuredOutput or refused naming the field; the core's
checks and the choice grammar; the wire; the worker's compiled-grammar LRU and bitmask unpacking.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokenization import Tokenization
from gateway.validation import Limits, chat_request, completion_request, generate_request
from splitserve.core import InvalidInput, SamplingParams
from splitserve.core.structured import MAX_CHOICES, MAX_STRUCTURED_BYTES, StructuredOutput, choice_grammar
from splitserve.errors import InvalidArgument
from splitserve.proto import gateway_pb2, types_pb2
from splitserve.wire import sampling_from_proto, sampling_to_proto
from tests.gateway_support import ByteTokenizer
from workers.engine.sampler import mask_disallowed, sample, token_logprobs
from workers.engine.structured import CompiledGrammarCache, compile_error_text, unpack_bitmask

TOK = Tokenization(ByteTokenizer(), max_model_len=64, vocab_size=300)
LIMITS = Limits(served_model="demo", max_model_len=64, default_max_tokens=16, max_tokens_limit=40)
DIFFUSION = Limits(served_model="demo", max_model_len=64, default_max_tokens=16, max_tokens_limit=40,
                   engine_family="diffusion")
HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def chat(limits=LIMITS, **body):
    return chat_request({"messages": HI, **body}, TOK, limits, "r1")


def completion(**body):
    return completion_request({"prompt": "hi", **body}, TOK, LIMITS, "r1")


def refused(call, param: str, *fragments: str, **body) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        call(**body)
    assert info.value.param == param, info.value.message
    for fragment in fragments:
        assert fragment in info.value.message
    return info.value


# --- the request fields

def test_response_format_json_schema_keeps_the_schema_and_its_key_order():
    got = chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                         "strict": True}}).structured_output
    assert (got.kind, got.param, got.any_whitespace) == ("json", "response_format", True)
    assert json.loads(got.spec) == SCHEMA and list(json.loads(got.spec)["properties"]) == ["name", "age"]
    # Both endpoints take it, and it rides in the SamplingParams the coordinator gets.
    sampling = completion(response_format={"type": "json_object"}).submit_request().sampling
    assert sampling.HasField("structured_output") and sampling.structured_output.kind == "json_object"
    assert not chat(response_format={"type": "text"}).submit_request().sampling.HasField("structured_output")


@pytest.mark.parametrize("body,expected", [
    ({"structured_outputs": {"json": SCHEMA}}, ("json", (), True)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}}, ("json", (), False)),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}}, ("regex", (), True)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ("yes", "no"), True)),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", (), True)),
    ({"structured_outputs": {"json_object": True, "regex": None}}, ("json_object", (), True)),
    ({"guided_json": SCHEMA}, ("json", (), True)),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, ("regex", (), True)),
    ({"guided_choice": ["a", "b\n"]}, ("choice", ("a", "b\n"), True)),
    ({"guided_grammar": 'root ::= "x"'}, ("grammar", (), True)),
])
def test_vllm_fields_become_one_constraint_naming_the_field(body, expected):
    got = chat(**body).structured_output
    assert (got.kind, got.choices, got.any_whitespace) == expected
    assert got.param == next(iter(body))
    assert sampling_from_proto(chat(**body).sampling_params()).structured_output == got


@pytest.mark.parametrize("body,param,fragment", [
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"guided_choice": "a"}, "guided_choice", "list of strings"),
    ({"guided_choice": ["x"] * (MAX_CHOICES + 1)}, "guided_choice", str(MAX_CHOICES)),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_regex": 3}, "guided_regex", "non-empty string"),
    ({"guided_grammar": "x" * (MAX_STRUCTURED_BYTES + 1)}, "guided_grammar", str(MAX_STRUCTURED_BYTES)),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1, 2]}, "guided_json", "JSON Schema object"),
    ({"guided_json": {"type": 3}}, "guided_json", "type must be"),
    ({"guided_json": {"description": "x" * MAX_STRUCTURED_BYTES}}, "guided_json", str(MAX_STRUCTURED_BYTES)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format", "strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "[]"}}}, "response_format",
     "JSON Schema object"),
    ({"response_format": {"type": "xml"}}, "response_format", "one of text, json_object, json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "must be true"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "backend_x": 1}}, "structured_outputs", "unknown option"),
    ({"structured_outputs": "a+"}, "structured_outputs", "must be an object"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    # One constraint per request: the second field asked is the one named.
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "only one"),
])
def test_bad_structured_fields_are_a_400_naming_the_field(body, param, fragment):
    refused(chat, param, fragment, **body)
    refused(completion, param, fragment, **body)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_deeply_nested_schema_is_refused_without_exhausting_the_stack():
    refused(chat, "guided_json", "levels deep", guided_json=_nested(5000))
    refused(chat, "guided_json", "levels deep", guided_json=json.dumps(_nested(200)))
    text = '{"items":' * 3000 + "{}" + "}" * 3000
    refused(chat, "guided_json", "not valid JSON", guided_json=text)  # past the JSON parser's own depth
    assert chat(guided_json=_nested(64)).structured_output.kind == "json"


def test_a_diffusion_model_refuses_structured_output_naming_the_field():
    refused(lambda **body: chat(DIFFUSION, **body), "guided_choice", "diffusion", guided_choice=["a"])
    refused(lambda **body: chat(DIFFUSION, **body), "response_format", "diffusion",
            response_format={"type": "json_object"})


def test_grpc_generate_takes_sampling_structured_output_shape_checked():
    def generate(**structured):
        sampling = types_pb2.SamplingParams(structured_output=types_pb2.StructuredOutput(**structured))
        return generate_request(gateway_pb2.GenerateRequest(text="hi", sampling=sampling), TOK, LIMITS, "r")

    got = generate(kind="json", spec='{"type": "object",  "properties": {}}', compact_json=True).structured_output
    assert (got.kind, got.spec, got.any_whitespace, got.param) == (
        "json", '{"type":"object","properties":{}}', False, "sampling.structured_output")
    with pytest.raises(InvalidArgument) as info:
        generate(kind="choice")
    assert info.value.param == "sampling.structured_output" and "empty" in info.value.message
    with pytest.raises(InvalidArgument) as info:
        generate(kind="json", spec="{")
    assert info.value.param == "sampling.structured_output" and "not valid JSON" in info.value.message


# --- the core and the wire

def test_the_core_checks_shape_and_size_naming_the_field():
    for bad, fragment in [(StructuredOutput("xml", "a", param="p"), "unknown"),
                          (StructuredOutput("regex", "", param="p"), "empty"),
                          (StructuredOutput("choice", param="p"), "empty"),
                          (StructuredOutput("json_object", "x", param="p"), "takes no"),
                          (StructuredOutput("regex", "a", ("b",), param="p"), "only a choice")]:
        with pytest.raises(InvalidInput) as info:
            SamplingParams(structured_output=bad).validate(100)
        assert info.value.param == "p" and fragment in info.value.message
    # The field it came from is not part of what is compiled (nor of the cache key).
    assert StructuredOutput("regex", "a", param="x") == StructuredOutput("regex", "a", param="y")


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["json", "json_object", "regex", "choice", "grammar"]), text=st.text(min_size=1),
       choices=st.lists(st.text(min_size=1), min_size=1, max_size=5), compact=st.booleans())
def test_the_wire_carries_every_constraint_exactly(kind, text, choices, compact):
    constraint = StructuredOutput(kind, "" if kind in ("json_object", "choice") else text,
                                  tuple(choices) if kind == "choice" else (), not compact, "guided_x")
    params = SamplingParams(structured_output=constraint)
    back = sampling_from_proto(types_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString()))
    assert back.structured_output == constraint and back.structured_output.param == "guided_x"
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).structured_output is None


def test_the_choice_grammar_escapes_what_ebnf_strings_cannot_hold():
    assert choice_grammar(["yes", "no"]) == 'root ::= "yes" | "no"'
    assert choice_grammar(['a"b', "c\\d", "e\nf\tg", "\x01"]) == (
        'root ::= "a\\"b" | "c\\\\d" | "e\\nf\\tg" | "\\x01"')


# --- the worker's pure parts

def test_the_compiled_grammar_cache_is_a_bounded_lru_that_does_not_cache_errors():
    cache, built = CompiledGrammarCache(2), []

    def build(key):
        def make():
            built.append(key)
            if key == "bad":
                raise ValueError("does not compile")
            return f"compiled {key}"
        return make

    assert cache.get("a", build("a")) == "compiled a" and cache.get("b", build("b")) == "compiled b"
    assert cache.get("a", build("a")) == "compiled a"  # a hit: a is now the most recent
    cache.get("c", build("c"))  # evicts b, the least recently used
    assert len(cache) == 2 and built == ["a", "b", "c"]
    cache.get("a", build("a")), cache.get("b", build("b"))
    assert built == ["a", "b", "c", "b"] and (cache.hits, cache.misses) == (2, 4)
    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get("bad", build("bad"))
    assert built.count("bad") == 2
    with pytest.raises(ValueError, match="structured_output_cache_size"):
        CompiledGrammarCache(0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=70, max_size=70), min_size=1, max_size=4))
def test_unpacking_a_bitmask_gives_back_every_bit(rows):
    vocab = 70  # three words, the last one partly past the vocabulary
    packed = torch.zeros(len(rows), 3, dtype=torch.int64)
    for r, row in enumerate(rows):
        for token, allowed in enumerate(row):
            if allowed:
                packed[r, token // 32] |= 1 << (token % 32)
    words = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # bit 31: a negative int32
    assert unpack_bitmask(words, vocab).tolist() == rows


def test_compile_errors_lose_xgrammars_source_location():
    err = RuntimeError("[05:16:44] /project/cpp/regex_converter.cc:94: Regex parsing error at position 4: "
                       "Unclosed '['\n")
    assert compile_error_text(err) == "Regex parsing error at position 4: Unclosed '['"


def test_the_grammar_mask_comes_first_and_wins_over_min_tokens_where_only_the_end_is_allowed():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2)
    allowed = torch.tensor([[True, True, False, True], [False, False, False, True]])
    masked = mask_disallowed(logits, [0, 1], allowed)
    assert logits.tolist() == [[0.0, 1.0, 2.0, 3.0]] * 2  # the caller's logits are left as they were
    greedy = [SamplingParams(temperature=0.0, min_tokens=5)] * 2
    # EOS (3) is held back on row 0, which takes its best other allowed token; on row 1 the
    # grammar allows only the end, and the grammar wins (min_tokens would leave no token).
    assert sample(masked, greedy, [1, 1], [0, 0], eos_token_ids=[3], grammar_rows=[0, 1]) == [1, 3]
    for seed in range(20):
        drawn = sample(masked, [SamplingParams(temperature=1.0)] * 2, [seed, seed], [0, 0])
        assert drawn[0] in (0, 1, 3) and drawn[1] == 3
    # Logprobs of the masked logits: row 1's one allowed token is certain, the refused ones -9999.
    found = token_logprobs(masked, [SamplingParams(logprobs=2)] * 2, [1, 3])
    assert found[1].logprob == 0.0 and found[1].top[0] == (3, 0.0) and found[1].top[1][1] == -9999.0
