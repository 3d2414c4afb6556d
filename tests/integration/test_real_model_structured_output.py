"""Structured output on the real model (SmolLM2-135M-Instruct, issue 37): what clients send as
OpenAI's response_format json_schema and json_object, with the default any-whitespace JSON,
parses and validates against the schema; and a request split into two stages on two engines
(the second built from the worker's wire message) produces the tokens of the unsplit one.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from real_model_support import chat_prompt_ids, real_model_dir

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar package (the dev extra installs it)")

from splitserve.core import KvPayload, SamplingParams, StageKey  # noqa: E402
from splitserve.core.structured import StructuredOutput  # noqa: E402
from splitserve.proto import types_pb2  # noqa: E402
from splitserve.wire import sampling_to_proto  # noqa: E402
from workers.engine import LLM, Engine, EngineConfig  # noqa: E402
from workers.wire import stage_spec_from_proto  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "country": {"type": "string", "maxLength": 40},
                                         "population_millions": {"type": "number"}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe Paris as a JSON object with its city, country and population."}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), block_size=16)


@pytest.fixture(scope="module")
def prompt(llm):
    return chat_prompt_ids(llm.engine.tokenizer, MESSAGES)


SCHEMA = StructuredOutput("json", json.dumps(CITY), param="response_format")


def test_response_format_output_parses_and_validates(llm, prompt):
    # Both in one batch, greedy and sampled: each row is masked by its own grammar.
    any_object = StructuredOutput("json_object", param="response_format")
    outs = llm.generate([prompt] * 2, [SamplingParams(max_tokens=MAX_TOKENS, structured_output=SCHEMA, temperature=0.0),
                                       SamplingParams(max_tokens=MAX_TOKENS, structured_output=any_object,
                                                      temperature=0.7, seed=3)])
    assert [o.finish_reason for o in outs] == ["stop", "stop"], [o.text for o in outs]
    jsonschema.validate(json.loads(outs[0].text), CITY)
    assert isinstance(json.loads(outs[1].text), dict)


def test_a_split_request_produces_the_unsplit_tokens(llm, model_dir, prompt):
    request = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3, structured_output=SCHEMA)
    expected = llm.generate([prompt], request)[0].token_ids
    alpha, beta = llm.engine, Engine(EngineConfig(model=str(model_dir), block_size=16))
    sampling = sampling_to_proto(request)
    for split in (len(prompt), len(prompt) + 7):  # prefill | decode, and mid-output (inside a JSON string)
        a = types_pb2.Stage(request_id=f"s{split}", end=split, prompt_token_ids=prompt, sampling=sampling,
                            keep_kv=True)
        key_a = StageKey(a.request_id, 0)
        alpha.add_stage(stage_spec_from_proto(a, key_a, None))
        first = _drain(alpha, key_a)
        b = types_pb2.Stage(request_id=a.request_id, stage_index=1, start=split, prompt_token_ids=prompt,
                            generated_token_ids=first, sampling=sampling)
        key_b = StageKey(b.request_id, 1)
        beta.add_stage(stage_spec_from_proto(b, key_b, KvPayload(alpha.export_kv(key_a, 0, split), split)))
        alpha.release(key_a)
        assert first + _drain(beta, key_b) == expected, split


def _drain(engine: Engine, key: StageKey) -> list[int]:
    tokens = []
    while engine.has_unfinished():
        tokens += [t for ev in engine.step() if ev.key == key for t in ev.token_ids]
    return tokens
