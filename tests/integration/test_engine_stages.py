"""A request run as two stages on two engines equals the colocated run, at any split point."""

from __future__ import annotations

import random

import pytest

from splitserve.core import KvInBlocks, KvPayload, StageKey, StageSpec
from workers.engine import Engine, EngineConfig, SamplingParams

from engine_support import drain

P, MAX_TOKENS = 37, 12
L = P + MAX_TOKENS



@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    model = str(tiny_model_dirs["qwen3"])
    return Engine(EngineConfig(model=model, block_size=8)), Engine(EngineConfig(model=model, block_size=8))


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(17)
    return [rng.randrange(259) for _ in range(P)]


PARAMS = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=40, seed=7, ignore_eos=True)]


@pytest.mark.parametrize("split", [1, P - 1, P, P + 1, P + 7, L - 1])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("via", ["tensor", "blocks"])
def test_two_stage_split_equals_colocated(engines, prompt, split, params, via):
    alpha, beta = engines
    full, a, b = StageKey("full"), StageKey("r", 0), StageKey("r", 1)
    alpha.add_stage(StageSpec(full, tuple(prompt), params))
    expected, _ = drain(alpha, full)

    alpha.add_stage(StageSpec(a, tuple(prompt), params, end=split, keep_kv=True))
    first, reason = drain(alpha, a)
    if split == L - 1:  # alpha generates every output token itself: a normal finish
        assert reason == "length" and first == expected
        alpha.release(a)
        return
    assert reason == "stage_end"
    assert len(first) == max(0, split - P + 1)
    if via == "tensor":
        kv = KvPayload(alpha.export_kv(a, 0, split), split)
    else:  # what a transfer does: whole blocks into blocks reserved on the receiver
        src_blocks, computed = alpha.kv_blocks(a)
        assert computed == split
        dst_blocks = beta.reserve_kv(split)
        n = len(dst_blocks)
        beta.runner.kv_cache[dst_blocks] = alpha.runner.kv_cache[src_blocks[:n]]
        kv = KvInBlocks(tuple(dst_blocks), split)
    beta.add_stage(StageSpec(b, tuple(prompt), params, output_ids=tuple(first), kv=kv))
    alpha.release(a)
    rest, reason = drain(beta, b)
    assert first + rest == expected
    assert reason == "length"
    for engine in engines:
        assert engine.load().free_blocks == engine.load().total_blocks


def alpha_kv(engine, prompt):
    key = StageKey("kv")
    engine.add_stage(StageSpec(key, tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True))
    drain(engine, key)
    kv = engine.export_kv(key, 0, 10)
    engine.release(key)
    return kv


def test_stage_end_and_kv_validation(engines, prompt):
    alpha, _ = engines
    with pytest.raises(ValueError, match=r"end \(5\) must be beyond the supplied KV \(10 tokens\)"):
        alpha.add_stage(StageSpec.whole("bad", prompt, PARAMS[0], kv=KvPayload(alpha_kv(alpha, prompt), 10), end=5))
    blocks = alpha.reserve_kv(P)
    with pytest.raises(ValueError, match=r"kv covers 37 tokens; it must cover 1..36"):
        alpha.add_stage(StageSpec.whole("bad2", prompt, PARAMS[0], kv=KvInBlocks(tuple(blocks), P)))
    alpha.release_reserved(blocks)
    assert alpha.load().free_blocks == alpha.load().total_blocks
