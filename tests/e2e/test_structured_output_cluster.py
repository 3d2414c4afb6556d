"""Structured output through a whole local cluster (issue 37): OpenAI's response_format, vLLM's
structured_outputs and guided_* fields over HTTP, the constraint carried by the gateway, the
coordinator and the stage to a real worker (xgrammar over the tiny Llama's byte tokenizer),
streamed and not; a constraint the worker cannot compile comes back as a 400 naming the field.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar package (the dev extra installs it)")

MESSAGES = [{"role": "user", "content": "Give me a color as JSON."}]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.gateway_http, timeout=120) as client:
        yield client


def chat(http, **body) -> dict:
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 64, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_guided_choice_answers_one_of_the_choices(http, temperature):
    answer = chat(http, guided_choice=CHOICES, temperature=temperature, seed=5)
    assert answer["message"]["content"] in CHOICES and answer["finish_reason"] == "stop"
    legacy = http.post("/v1/completions", json={"prompt": "Sentiment:", "max_tokens": 16, "temperature": temperature,
                                                "structured_outputs": {"choice": CHOICES}}).json()["choices"][0]
    assert legacy["text"] in CHOICES and legacy["finish_reason"] == "stop"


def test_json_schema_output_parses_and_validates_streamed_or_not(http):
    body = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}, "temperature": 0.8, "seed": 11}
    answer = chat(http, **body)
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["message"]["content"]), SCHEMA)
    streamed = ""
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": MESSAGES, "max_tokens": 64, "stream": True, **body}) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    streamed += choice.get("delta", {}).get("content") or ""
    assert streamed == answer["message"]["content"]


def test_response_format_json_object_is_a_json_object(http):
    answer = chat(http, response_format={"type": "json_object"}, temperature=0)
    assert answer["finish_reason"] == "stop" and isinstance(json.loads(answer["message"]["content"]), dict)


def test_guided_regex_on_legacy_completions(http):
    reply = http.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 24, "temperature": 0.9, "seed": 2,
                                               "guided_regex": "[A-Z]{3}-[0-9]{2,4}"})
    assert reply.status_code == 200, reply.text
    assert re.fullmatch("[A-Z]{3}-[0-9]{2,4}", reply.json()["choices"][0]["text"])


@pytest.mark.parametrize("field,value,fragment", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "does not compile"),
    ("guided_regex", "[a-", "does not compile"),
    ("guided_grammar", "root ::= missing", "does not compile"),
    ("guided_choice", [], "empty"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(http, field, value, fragment):
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["type"]) == (field, "invalid_request_error")
    assert fragment in error["message"], error["message"]


def test_logprobs_of_a_constrained_answer_are_finite_json(http):
    """Refused tokens are -inf under the grammar's mask: vLLM's API shows them as -9999.0."""
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                                                    "guided_choice": CHOICES, "logprobs": True, "top_logprobs": 5})
    assert reply.status_code == 200, reply.text
    json.loads(reply.text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert content and all(-9999.0 <= top["logprob"] <= 0 for entry in content for top in entry["top_logprobs"])
    assert any(top["logprob"] == -9999.0 for entry in content for top in entry["top_logprobs"])
