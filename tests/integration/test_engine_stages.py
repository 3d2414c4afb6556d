"""A request run as two stages on two engines equals the colocated run, at any split point."""

from __future__ import annotations

import random

import pytest

from workers.engine import Engine, EngineConfig, SamplingParams

P, MAX_TOKENS = 37, 12
L = P + MAX_TOKENS


def _drain(engine: Engine, request_id: str) -> tuple[list[int], str]:
    tokens, reason = [], None
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.request_id == request_id:
                tokens += ev.token_ids
                reason = ev.finish_reason or reason
    return tokens, reason


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
    alpha.add_request("full", prompt, params)
    expected, _ = _drain(alpha, "full")

    alpha.add_request("a", prompt, params, stop_at=split, keep_kv=True)
    first, reason = _drain(alpha, "a")
    if split == L - 1:  # alpha generates every output token itself: a normal finish
        assert reason == "length" and first == expected
        alpha.release("a")
        return
    assert reason == "stage_end"
    assert len(first) == max(0, split - P + 1)
    if via == "tensor":
        kv = alpha.export_kv("a", 0, split)
        beta.add_request("b", prompt, params, output_token_ids=first, prefix_kv=kv)
    else:  # what a transfer does: whole blocks into blocks reserved on the receiver
        src_blocks, computed = alpha.kv_blocks("a")
        assert computed == split
        dst_blocks = beta.reserve_kv(split)
        n = len(dst_blocks)
        beta.runner.kv_cache[dst_blocks] = alpha.runner.kv_cache[src_blocks[:n]]
        beta.add_request("b", prompt, params, output_token_ids=first, prefix_blocks=dst_blocks, prefix_len=split)
    alpha.release("a")
    rest, reason = _drain(beta, "b")
    assert first + rest == expected
    assert reason == "length"
    for engine in engines:
        assert engine.stats().free_blocks == engine.stats().total_blocks


def alpha_kv(engine, prompt):
    engine.add_request("kv", prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    _drain(engine, "kv")
    kv = engine.export_kv("kv", 0, 10)
    engine.release("kv")
    return kv


def test_stop_at_validation(engines, prompt):
    alpha, _ = engines
    with pytest.raises(ValueError, match="stop_at"):
        alpha.add_request("bad", prompt, PARAMS[0], prefix_kv=alpha_kv(alpha, prompt), stop_at=5)
    blocks = alpha.reserve_kv(16)
    with pytest.raises(ValueError, match="prefix_len"):
        alpha.add_request("bad2", prompt, PARAMS[0], prefix_blocks=blocks, prefix_len=P)
    alpha.release_reserved(blocks)
    assert alpha.stats().free_blocks == alpha.stats().total_blocks
