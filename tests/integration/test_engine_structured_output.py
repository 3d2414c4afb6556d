"""Structured output on the real engine (issue 37), a tiny random Llama with its byte tokenizer:
the output follows the grammar (a choice is one of the choices, JSON parses and validates against
its schema), finishes with "stop" where the grammar ends, and is token-exact across stages: a
request split into two stages on two engines at any token, the second stage built from the
worker's wire message (prompt_token_ids, generated_token_ids, sampling), produces the tokens of
the unsplit request. Logprobs are those of the grammar-masked logits (vLLM's); a constraint that
does not compile, a worker without xgrammar, the emulated backend and a diffusion worker refuse
naming the request's field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jsonschema
import pytest

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar package (the dev extra installs it)")

from splitserve.core import InvalidInput, KvPayload, SamplingParams, StageKey, StageSpec  # noqa: E402
from splitserve.core.structured import StructuredOutput  # noqa: E402
from splitserve.proto import types_pb2  # noqa: E402
from splitserve.wire import sampling_to_proto  # noqa: E402
from workers.engine import LLM, Engine, EngineConfig  # noqa: E402
from workers.engine.structured import load_backend  # noqa: E402
from workers.wire import stage_spec_from_proto  # noqa: E402

from engine_support import drain  # noqa: E402

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"], "additionalProperties": False}
CHOICES = ("yes", "no", "maybe so", 'say "hi"')
CONSTRAINTS = {
    "json": StructuredOutput("json", json.dumps(SCHEMA), any_whitespace=False, param="response_format"),
    "choice": StructuredOutput("choice", choices=CHOICES, param="guided_choice"),
    "regex": StructuredOutput("regex", r"(ab|c)+[0-9]{2}", param="guided_regex"),
}
MAX_TOKENS = 48
SAMPLED = dict(temperature=1.0, seed=1234)



@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, block_size=4)


@pytest.fixture(scope="module")
def engines(model):
    return Engine(EngineConfig(model=model, block_size=4)), Engine(EngineConfig(model=model, block_size=4))


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenize("Answer in JSON:")


def params(name: str, sampled: bool, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_output=CONSTRAINTS[name],
                          **(SAMPLED if sampled else dict(temperature=0.0)), **extra)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_output_follows_the_grammar_and_stops_where_it_ends(llm, prompt, sampled):
    free = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, **(SAMPLED if sampled else {})))[0]
    assert free.text not in CHOICES  # the random model alone says something else
    out = llm.generate([prompt], params("json", sampled))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.spec.eos_token_ids
    jsonschema.validate(json.loads(out.text), SCHEMA)
    choice = llm.generate([prompt], params("choice", sampled))[0]
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    regex = llm.generate([prompt], params("regex", sampled))[0]
    assert regex.finish_reason == "stop"
    assert __import__("re").fullmatch(r"(ab|c)+[0-9]{2}", regex.text), regex.text


def test_the_grammar_ends_the_output_even_with_ignore_eos_and_wins_over_min_tokens(llm, prompt):
    out = llm.generate([prompt], params("choice", False, ignore_eos=True))[0]
    assert out.text in CHOICES and out.finish_reason == "stop"
    # min_tokens holds EOS back; where the grammar allows only the end, the grammar wins.
    held = llm.generate([prompt], params("choice", True, min_tokens=20))[0]
    assert held.text in CHOICES and held.finish_reason == "stop"


def test_logprobs_are_those_of_the_grammar_masked_distribution_as_vllm_gives_them(engines, prompt):
    engine = engines[0]

    def logprobs(request_id: str, sampling: SamplingParams) -> list:
        key = StageKey(request_id)
        engine.add_stage(StageSpec(key, tuple(prompt), sampling))
        found = []
        while engine.has_unfinished():
            found += [lp for ev in engine.step() if ev.key == key for lp in ev.logprobs]
        return found

    free = logprobs("free", SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    first = logprobs("constrained", params("choice", False, logprobs=5))[0]
    # vLLM applies the grammar's bitmask to the logits before its sampler, which takes the
    # logprobs from them: the choices' first bytes share all the probability, a refused token
    # is -inf (shown as vLLM's -9999.0: JSON has no -inf), and greedy takes the top one.
    allowed = {ord(choice[0]) for choice in CHOICES}
    ids, values = [t for t, _ in first.top], [v for _, v in first.top]
    assert set(ids[:4]) == allowed and values[4] == -9999.0 and ids[4] not in allowed
    assert sum(math.exp(v) for v in values[:4]) == pytest.approx(1.0, abs=1e-5)
    assert first.logprob == values[0]
    assert free.top[0][0] not in allowed and free.top[0][1] > -9999.0  # the model's favourite, refused here


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_split_at_any_token_equals_the_unsplit_request(llm, engines, prompt, name, sampled):
    request = params(name, sampled)
    expected = llm.generate([prompt], request)[0].token_ids
    p = len(prompt)
    alpha, beta = engines
    sampling = sampling_to_proto(request)  # both stages get the constraint as the wire carries it
    for split in sorted({1, p - 1, p, p + 1, p + 2, p + len(expected) // 2, p + len(expected) - 1}):
        a = types_pb2.Stage(request_id=f"{name}-{sampled}-{split}", stage_index=0, start=0, end=split,
                            prompt_token_ids=prompt, sampling=sampling, keep_kv=True)
        key_a = StageKey(a.request_id, 0)
        alpha.add_stage(stage_spec_from_proto(a, key_a, None))
        first, reason = drain(alpha, key_a)
        if reason != "stage_end":  # the request ended before the split point
            alpha.release(key_a)
            assert first == expected
            continue
        b = types_pb2.Stage(request_id=a.request_id, stage_index=1, start=split, prompt_token_ids=prompt,
                            generated_token_ids=first, sampling=sampling)
        key_b = StageKey(b.request_id, 1)
        beta.add_stage(stage_spec_from_proto(b, key_b, KvPayload(alpha.export_kv(key_a, 0, split), split)))
        alpha.release(key_a)
        rest, reason = drain(beta, key_b)
        assert (first + rest, reason) == (expected, "stop"), split


@pytest.mark.parametrize("constraint,fragment", [
    (StructuredOutput("json", '{"type": "nonsense"}', param="response_format"), "Unsupported type"),
    (StructuredOutput("regex", "[a-", param="guided_regex"), "Unclosed"),
    (StructuredOutput("grammar", "root ::= undefined_rule", param="structured_outputs"), "not defined"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_the_field(engines, prompt, constraint, fragment):
    engine = engines[0]
    with pytest.raises(InvalidInput) as info:
        engine.add_stage(stage_spec_from_proto(types_pb2.Stage(
            request_id="bad", prompt_token_ids=prompt, sampling=sampling_to_proto(SamplingParams(
                max_tokens=4, structured_output=constraint))), StageKey("bad", 0), None))
    assert info.value.param == constraint.param and fragment in info.value.message
    assert not engine.has_unfinished()


def test_a_stage_whose_earlier_output_breaks_the_grammar_is_refused(engines, prompt):
    stage = types_pb2.Stage(request_id="off", prompt_token_ids=prompt, generated_token_ids=list(b"zz"),
                            sampling=sampling_to_proto(params("choice", False)))
    with pytest.raises(InvalidInput) as info:
        engines[0].add_stage(stage_spec_from_proto(stage, StageKey("off", 1), None))
    assert info.value.param == "output_token_ids"


def test_without_xgrammar_the_request_is_refused_naming_its_field(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    with pytest.raises(InvalidInput) as info:
        load_backend(llm.engine.tokenizer, 384, [1], 4, "guided_json")
    assert info.value.param == "guided_json" and "splitserve[structured]" in info.value.message


def test_the_emulated_backend_refuses_structured_output_as_it_refuses_logprobs():
    from workers.engine.emulated import Emulation, build_emulated_engine

    engine = build_emulated_engine(EngineConfig(model="", kv_cache_memory_bytes=1 << 30), Emulation("H100", "llama-3-8b"))
    with pytest.raises(InvalidInput) as info:
        engine.add_stage(dataclasses.replace(
            stage_spec_from_proto(types_pb2.Stage(request_id="e", prompt_token_ids=[5, 6, 7]), StageKey("e", 0), None),
            sampling=SamplingParams(max_tokens=4, structured_output=CONSTRAINTS["choice"])))
    assert info.value.param == "guided_choice" and "emulated" in info.value.message


def test_a_diffusion_worker_refuses_structured_output_naming_the_field():
    from workers.diffusion.emulated import DiffusionEmulation, build_emulated_diffusion_engine

    engine = build_emulated_diffusion_engine(EngineConfig(model="", kv_cache_memory_bytes=1 << 30),
                                             DiffusionEmulation("RTX4090"))
    with pytest.raises(InvalidInput) as info:
        engine.add_stage(StageSpec(StageKey("d"), (5, 6, 7), SamplingParams(
            max_tokens=8, structured_output=CONSTRAINTS["json"])))
    assert info.value.param == "response_format" and "diffusion" in info.value.message
