"""Prompt logprobs on the real engine (issue 37: completions' echo with logprobs, vLLM's
prompt_logprobs): every prompt token but the first scored from the position before it, equal
to transformers' log_softmax over the same model's logits, whether the prompt is prefilled in
one step, in chunks (a small token budget), after its prefix was cached (the cache is not
used for such a request), or split over two stages on two engines at any token: each stage's
TokenChunks (through the worker's wire conversion) carry the positions it computed, and the
positions stitched together are the whole prompt's."""

from __future__ import annotations

import pytest
import torch

from splitserve.core import KvPayload, SamplingParams, StageKey
from splitserve.core.sampling import TokenLogprobs
from splitserve.proto import types_pb2
from splitserve.wire import sampling_to_proto, token_logprobs_from_proto
from workers.engine import Engine, EngineConfig
from workers.wire import stage_spec_from_proto, token_chunk

P, TOP = 23, 3
PROMPT = [(i * 7) % 17 + 3 for i in range(P)]
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
# float32 forward passes through other kernels (paged attention, chunked prefill) than
# transformers' eager one: equal to ~1e-6; 1e-4 is far below what a client compares.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def reference(model_dir) -> list[TokenLogprobs]:
    """transformers' logprob of each prompt token 1..P-1 and the top TOP at its position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    own = logprobs.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1).tolist()
    values, ids = logprobs.topk(TOP, dim=-1)
    return [TokenLogprobs(v, tuple(zip(i, t))) for v, i, t in zip(own, ids.tolist(), values.tolist())]


@pytest.fixture(scope="module")
def engines(model_dir):
    # A token budget of 8: the prompt is prefilled in chunks of at most 8 tokens.
    config = dict(model=model_dir, block_size=4, max_num_batched_tokens=8)
    return Engine(EngineConfig(**config)), Engine(EngineConfig(**config))


def _run(engine: Engine, stage: types_pb2.Stage, key: StageKey, kv=None) -> tuple[dict[int, TokenLogprobs], str]:
    """The prompt logprobs the stage's chunks carry, by position, and its finish reason."""
    engine.add_stage(stage_spec_from_proto(stage, key, kv))
    scored: dict[int, TokenLogprobs] = {}
    reason = ""
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.key != key:
                continue
            chunk = types_pb2.TokenChunk.FromString(token_chunk(stage, ev, "w", 0).SerializeToString())
            for position, record in enumerate(chunk.prompt_logprobs, chunk.prompt_logprobs_start):
                assert position not in scored
                scored[position] = token_logprobs_from_proto(record)
            reason = chunk.finish_reason or reason
    return scored, reason


def _assert_reference(scored: dict[int, TokenLogprobs], reference: list[TokenLogprobs]) -> None:
    assert sorted(scored) == list(range(1, P))
    for position, expected in enumerate(reference, 1):
        got = scored[position]
        assert got.logprob == pytest.approx(expected.logprob, abs=TOLERANCE), position
        assert [t for t, _ in got.top] == [t for t, _ in expected.top], position
        assert [v for _, v in got.top] == pytest.approx([v for _, v in expected.top], abs=TOLERANCE)


def _stage(request_id: str, **fields) -> types_pb2.Stage:
    return types_pb2.Stage(request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling_to_proto(PARAMS),
                           **fields)


def test_a_chunked_prefill_scores_every_prompt_token_as_transformers_does(engines, reference):
    assert engines[0].config.max_num_batched_tokens < P
    scored, reason = _run(engines[0], _stage("whole"), StageKey("whole", 0))
    assert reason == "length"
    _assert_reference(scored, reference)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(engines, reference):
    engine = engines[1]
    warm = types_pb2.Stage(request_id="warm", prompt_token_ids=PROMPT,
                           sampling=sampling_to_proto(SamplingParams(max_tokens=1, temperature=0.0)))
    _run(engine, warm, StageKey("warm", 0))
    hits = engine.load().prefix_hit_tokens
    scored, _ = _run(engine, _stage("after-cache"), StageKey("after-cache", 0))
    _assert_reference(scored, reference)
    assert engine.load().prefix_hit_tokens == hits  # nothing taken from the cache


def test_no_prompt_logprobs_unless_asked(engines):
    plain = types_pb2.Stage(request_id="plain", prompt_token_ids=PROMPT,
                            sampling=sampling_to_proto(SamplingParams(max_tokens=2, temperature=0.0)))
    assert _run(engines[0], plain, StageKey("plain", 0))[0] == {}


@pytest.mark.parametrize("split", [1, 2, 9, P - 1, P, P + 1])
def test_a_split_prompt_is_scored_by_both_stages_and_stitches_to_the_whole(engines, reference, split):
    alpha, beta = engines
    request_id = f"split-{split}"
    a = _stage(request_id, stage_index=0, start=0, end=split, keep_kv=True)
    key_a = StageKey(request_id, 0)
    first, reason = _run(alpha, a, key_a)
    assert reason == "stage_end"
    generated = []
    if split >= P:  # the first stage sampled the first token(s) too
        generated = list(alpha.scheduler.sequences[key_a].token_ids[P:])
    b = _stage(request_id, stage_index=1, start=split, generated_token_ids=generated)
    kv = KvPayload(alpha.export_kv(key_a, 0, split), split)
    alpha.release(key_a)
    second, reason = _run(beta, b, StageKey(request_id, 1), kv)
    assert reason == "length"
    assert set(first).isdisjoint(second)
    assert sorted(first) == list(range(1, min(split, P - 1) + 1))  # the positions alpha computed score these
    _assert_reference({**first, **second}, reference)
