"""Sampled-token logprobs on the real engine (issue 37): a request split into two stages on two
engines at any token, the second stage built from the worker's wire message (prompt, generated
tokens, sampling) as a worker receives it, and its chunks through the worker's wire conversion,
gets the tokens of the same request run whole on one engine, and its logprobs (to float32
rounding: LOGPROB_TOLERANCE); those are the raw log_softmax of the model's logits, whatever
temperature and penalties the request samples with."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.core import KvPayload, SamplingParams, StageKey
from splitserve.core.sampling import TokenLogprobs
from splitserve.proto import types_pb2
from splitserve.wire import sampling_from_proto, sampling_to_proto, token_logprobs_from_proto
from workers.engine import Engine, EngineConfig
from workers.wire import stage_spec_from_proto, token_chunk

P, MAX_TOKENS, TOP = 19, 12, 5
L = P + MAX_TOKENS
PROMPT = [(i * 5) % 13 + 3 for i in range(P)]
CASES = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=40, seed=77, presence_penalty=0.5,
                              repetition_penalty=1.3, logprobs=TOP, ignore_eos=True),
    "sampled_only": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, seed=5, logprobs=0, ignore_eos=True),
}


def _drain(engine: Engine, stage: types_pb2.Stage, key: StageKey) -> tuple[list[int], list[TokenLogprobs], str]:
    """The stage's tokens and logprobs as its worker streams them (TokenChunk messages, read back)."""
    tokens, logprobs, reason = [], [], ""
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.key == key:
                chunk = types_pb2.TokenChunk.FromString(token_chunk(stage, ev, "w", 0).SerializeToString())
                assert len(chunk.logprobs) == len(chunk.token_ids)
                tokens += chunk.token_ids
                logprobs += [token_logprobs_from_proto(lp) for lp in chunk.logprobs]
                reason = chunk.finish_reason or reason
    return tokens, logprobs, reason


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    return Engine(EngineConfig(model=model, block_size=4)), Engine(EngineConfig(model=model, block_size=4))


@pytest.fixture(scope="module")
def whole(engines):
    """Each case run unsplit on one engine."""
    out = {}
    for name, params in CASES.items():
        stage = types_pb2.Stage(request_id=f"whole-{name}", prompt_token_ids=PROMPT, sampling=sampling_to_proto(params))
        key = StageKey(stage.request_id, 0)
        engines[0].add_stage(stage_spec_from_proto(stage, key, None))
        out[name] = _drain(engines[0], stage, key)[:2]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_token_carries_its_logprob_and_the_top_n(whole, name):
    tokens, logprobs = whole[name]
    assert len(tokens) == len(logprobs) == MAX_TOKENS
    n = CASES[name].logprobs
    for token, record in zip(tokens, logprobs):
        assert len(record.top) == n and record.logprob <= 0.0
        values = [v for _, v in record.top]
        assert values == sorted(values, reverse=True)
        if n and CASES[name].temperature == 0.0:
            assert record.top[0] == (token, record.logprob)  # greedy samples the most likely token


def test_temperature_and_penalties_do_not_change_the_logprobs_of_a_token(engines, whole):
    """The same prompt's first token under another temperature and penalties: the raw distribution."""
    tokens, logprobs = whole["greedy"]
    params = dataclasses.replace(CASES["sampled"], max_tokens=1, temperature=1e-6)  # greedy in effect
    stage = types_pb2.Stage(request_id="tempered", prompt_token_ids=PROMPT, sampling=sampling_to_proto(params))
    key = StageKey(stage.request_id, 0)
    engines[1].add_stage(stage_spec_from_proto(stage, key, None))
    first, first_logprobs, _ = _drain(engines[1], stage, key)
    assert first_logprobs[0].top == logprobs[0].top
    assert dict(first_logprobs[0].top)[first[0]] == first_logprobs[0].logprob


@pytest.mark.parametrize("split", [1, P - 1, P, P + 1, P + 4, L - 1])
@pytest.mark.parametrize("name", list(CASES))
def test_split_at_any_token_equals_the_whole_request(engines, whole, split, name):
    expected_tokens, expected_logprobs = whole[name]
    sampling = sampling_to_proto(CASES[name])
    assert sampling_from_proto(sampling).logprobs == CASES[name].logprobs
    alpha, beta = engines
    a = types_pb2.Stage(request_id=f"{name}-{split}", stage_index=0, start=0, end=split, prompt_token_ids=PROMPT,
                        sampling=sampling, keep_kv=True)
    key_a = StageKey(a.request_id, 0)
    alpha.add_stage(stage_spec_from_proto(a, key_a, None))
    first, first_logprobs, reason = _drain(alpha, a, key_a)
    if reason != "stage_end":  # the request ended (length) with this stage
        alpha.release(key_a)
        assert first == expected_tokens
        # Same engine as the whole run, but the prompt now hits its prefix cache: the last bits
        # may differ as in any split (LOGPROB_TOLERANCE).
        _assert_same_logprobs(first_logprobs, expected_logprobs)
        return
    b = types_pb2.Stage(request_id=a.request_id, stage_index=1, start=split, prompt_token_ids=PROMPT,
                        generated_token_ids=first, sampling=sampling)
    key_b = StageKey(b.request_id, 1)
    beta.add_stage(stage_spec_from_proto(b, key_b, KvPayload(alpha.export_kv(key_a, 0, split), split)))
    alpha.release(key_a)
    rest, rest_logprobs, _ = _drain(beta, b, key_b)
    assert first + rest == expected_tokens
    _assert_same_logprobs(first_logprobs + rest_logprobs, expected_logprobs)


# The tokens are exact; a logprob is exact up to the float32 rounding of the forward pass, which
# differs in the last bits where the split stage computes a position through another attention
# path than the whole request did (a one-token decode step where the whole request prefilled a
# chunk): ~1e-7 relative, far below the 4 decimals clients print.
LOGPROB_TOLERANCE = 1e-5


def _assert_same_logprobs(got: list[TokenLogprobs], expected: list[TokenLogprobs]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.logprob == pytest.approx(e.logprob, abs=LOGPROB_TOLERANCE)
        assert [t for t, _ in g.top] == [t for t, _ in e.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=LOGPROB_TOLERANCE)
