"""vLLM's penalties, min_p and min_tokens on the real engine (issue 37): the offline LLM's tokens
equal those of the request split into two stages on two engines at any token, the second stage
built from the worker's wire message (prompt_token_ids, generated_token_ids, sampling) as a
worker receives it."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.core import KvPayload, SamplingParams, StageKey
from splitserve.proto import types_pb2
from splitserve.wire import sampling_from_proto, sampling_to_proto
from workers.engine import LLM, Engine, EngineConfig
from workers.wire import stage_spec_from_proto

from engine_support import drain

P, MAX_TOKENS, MIN_TOKENS = 23, 16, 6
L = P + MAX_TOKENS
PROMPT = [(i * 7) % 11 + 3 for i in range(P)]  # few distinct tokens: the penalties bite
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)



@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model)


@pytest.fixture(scope="module")
def engines(model):
    return Engine(EngineConfig(model=model, block_size=4)), Engine(EngineConfig(model=model, block_size=4))


@pytest.fixture(scope="module")
def cases(llm):
    """Greedy and sampled requests with every field; each stops at a token that, without
    min_tokens, it would produce first (so min_tokens decides how long the output is)."""
    built = []
    for base in (dict(temperature=0.0), dict(temperature=0.9, min_p=0.05, seed=1234)):
        params = SamplingParams(max_tokens=MAX_TOKENS, **base, **PENALTIES)
        first = llm.generate([PROMPT], params)[0].token_ids[0]
        built.append(dataclasses.replace(params, stop_token_ids=[first], min_tokens=MIN_TOKENS))
    return built


def test_the_fields_change_the_output_and_min_tokens_holds_back_the_stop_token(llm, cases):
    for params in cases:
        plain = dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                    min_p=0.0, stop_token_ids=[], ignore_eos=True)
        assert llm.generate([PROMPT], plain)[0].token_ids != llm.generate(
            [PROMPT], dataclasses.replace(params, stop_token_ids=[], min_tokens=0, ignore_eos=True))[0].token_ids
        # Without min_tokens the request stops at once; with it, not before MIN_TOKENS tokens.
        stop = params.stop_token_ids[0]
        assert llm.generate([PROMPT], dataclasses.replace(params, min_tokens=0))[0].token_ids == [stop]
        out = llm.generate([PROMPT], params)[0]
        assert len(out.token_ids) >= MIN_TOKENS and stop not in out.token_ids[:MIN_TOKENS]


@pytest.mark.parametrize("split", [1, P - 1, P, P + 1, P + 3, P + MIN_TOKENS, P + MIN_TOKENS + 2, L - 1])
@pytest.mark.parametrize("case", [0, 1], ids=["greedy", "sampled"])
def test_split_at_any_token_equals_the_offline_llm(llm, engines, cases, split, case):
    params = cases[case]
    expected = llm.generate([PROMPT], params)[0].token_ids
    alpha, beta = engines
    sampling = sampling_to_proto(params)  # both stages get the parameters as the wire carries them
    assert sampling_from_proto(sampling) == dataclasses.replace(
        params, **{name: float(getattr(sampling, name)) for name in
                   ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "temperature")})
    a = types_pb2.Stage(request_id=f"r{case}-{split}", stage_index=0, start=0, end=split, prompt_token_ids=PROMPT,
                        sampling=sampling, keep_kv=True)
    key_a = StageKey(a.request_id, 0)
    alpha.add_stage(stage_spec_from_proto(a, key_a, None))
    first, reason = drain(alpha, key_a)
    if reason != "stage_end":  # the request ended (stop, length) before the split point
        alpha.release(key_a)
        assert first == expected
        return
    b = types_pb2.Stage(request_id=a.request_id, stage_index=1, start=split, prompt_token_ids=PROMPT,
                        generated_token_ids=first, sampling=sampling)
    key_b = StageKey(b.request_id, 1)
    beta.add_stage(stage_spec_from_proto(b, key_b, KvPayload(alpha.export_kv(key_a, 0, split), split)))
    alpha.release(key_a)
    rest, _ = drain(beta, key_b)
    assert first + rest == expected
