"""Engine behaviour on a real tiny model: seeded sampling, stops, bad input, KV export/import."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from splitserve.core import KvPayload, StageKey, StageSpec
from workers.engine import LLM, Engine, EngineConfig, SamplingParams


def _prompts(n, lo, hi, seed, vocab=259):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


SEEDED = [
    SamplingParams(max_tokens=14, temperature=0.9, seed=11),
    SamplingParams(max_tokens=14, temperature=1.3, top_k=20, seed=12),
    SamplingParams(max_tokens=14, temperature=0.7, top_p=0.8, seed=13),
    SamplingParams(max_tokens=14, temperature=1.0, top_k=50, top_p=0.9, seed=14),
]


def test_seeded_sampling_independent_of_batching_chunking_preemption(llama_dir):
    prompts = _prompts(4, 5, 80, seed=21)
    alone = [LLM(str(llama_dir)).generate([p], sp)[0].token_ids for p, sp in zip(prompts, SEEDED)]
    batched = [o.token_ids for o in LLM(str(llama_dir)).generate(prompts, SEEDED)]
    chunked = [o.token_ids for o in LLM(str(llama_dir), max_num_batched_tokens=8, block_size=4).generate(prompts, SEEDED)]
    small = LLM(str(llama_dir), block_size=4)
    small_pool = LLM(str(llama_dir), block_size=4, kv_cache_memory_bytes=26 * small.engine.runner.bytes_per_block)
    preempted = [o.token_ids for o in small_pool.generate(prompts, SEEDED)]
    assert small_pool.engine.scheduler.num_preemptions > 0
    assert alone == batched == chunked == preempted
    # and the seed matters
    other = LLM(str(llama_dir)).generate(prompts[:1], SamplingParams(max_tokens=14, temperature=0.9, seed=99))
    assert other[0].token_ids != alone[0]


def test_continuing_from_generated_tokens_matches(llm):
    """A request resumed from its first k outputs (a split/migration) yields the same rest."""
    prompt = _prompts(1, 30, 30, seed=5)[0]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    full = llm.generate([prompt], params)[0].token_ids
    engine = llm.engine
    engine.add_stage(StageSpec.whole("resume", prompt, params, output_ids=tuple(full[:5])))
    rest = []
    while engine.has_unfinished():
        for ev in engine.step():
            rest += ev.token_ids
    assert full[:5] + rest == full


def test_kv_export_import_roundtrip(llama_dir):
    """Prefix KV computed on one engine and imported into another gives the same output."""
    prompt = _prompts(1, 45, 45, seed=8)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    a = Engine(EngineConfig(model=str(llama_dir), block_size=8))
    key = StageKey("r")
    a.add_stage(StageSpec(key, tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True))
    first = []
    while a.has_unfinished():
        first += [t for ev in a.step() for t in ev.token_ids]
    kv = a.export_kv(key, 0, len(prompt))
    assert kv.shape == (a.spec.num_layers, 2, len(prompt), a.spec.num_kv_heads, a.spec.head_dim)
    a.release(key)
    assert a.load().free_blocks == a.load().total_blocks

    b = Engine(EngineConfig(model=str(llama_dir), block_size=16))
    b.add_stage(StageSpec(key, tuple(prompt), params, output_ids=tuple(first), kv=KvPayload(kv, len(prompt))))
    assert b.export_kv(key, 0, len(prompt)).equal(kv)  # bit-exact after import
    out = list(first)
    while b.has_unfinished():
        out += [t for ev in b.step() for t in ev.token_ids]
    expected = LLM(str(llama_dir)).generate([prompt], params)[0].token_ids
    assert out == expected


def test_stop_token_ids_eos_and_ignore_eos(llm):
    prompt = _prompts(1, 10, 10, seed=2)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert free.finish_reason == "length"
    stop_at = free.token_ids[4]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    # pretend the model's EOS is that token: generation stops unless ignore_eos
    scheduler = llm.engine.scheduler
    config = scheduler.config
    scheduler.config = dataclasses.replace(config, eos_token_ids=config.eos_token_ids | {stop_at})
    try:
        eos = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
        ignored = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    finally:
        scheduler.config = config
    assert eos.finish_reason == "stop" and eos.token_ids == out.token_ids
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_strings_truncate_text_and_never_leak_in_stream(llm):
    # Byte-level tokenizer: token ids < 256 are bytes, so greedy output has a known text.
    prompt = list(b"the quick brown fox")
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    text = free.text
    assert len(text) >= 4, "need some decodable output to pick a stop string from"
    stop = text[2:4]
    engine = llm.engine
    engine.add_stage(StageSpec.whole("s", prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=[stop])))
    streamed, reason = "", None
    while engine.has_unfinished():
        for ev in engine.step():
            streamed += ev.text
            reason = ev.finish_reason or reason
    assert reason == "stop"
    assert streamed == text[: text.index(stop)]


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "prompt must contain at least 1 token"),
        ([1, 2, 999], SamplingParams(), "outside the vocabulary [0, 384)"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be an integer > 0"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens must be an integer > 0"),
        ([1, 2], SamplingParams(max_tokens=600), "exceeds max_model_len (512)"),
        ([1] * 500, SamplingParams(max_tokens=20), "exceeds max_model_len (512)"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        ([1, 2], SamplingParams(top_k=-1), "top_k must be >= 0"),
        ([1, 2], SamplingParams(stop_token_ids=[4000]), "stop_token_ids must be in [0, 384)"),
    ],
)
def test_bad_input_is_rejected_by_name_and_engine_keeps_serving(llm, prompt, params, message):
    engine = llm.engine
    engine.add_stage(StageSpec.whole("ok", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0)))
    with pytest.raises(ValueError) as err:
        engine.add_stage(StageSpec.whole("bad", prompt, params))
    assert message in str(err.value)
    produced = []
    while engine.has_unfinished():
        produced += [t for ev in engine.step() for t in ev.token_ids]
    assert len(produced) == 3
    assert not engine.stage_keys("bad")


def test_kv_capacity_limits_are_named(llama_dir):
    with pytest.raises(ValueError, match="holds no KV block"):
        Engine(EngineConfig(model=str(llama_dir), block_size=4, kv_cache_memory_bytes=1))
    probe = Engine(EngineConfig(model=str(llama_dir), block_size=4, kv_cache_memory_bytes=1 << 20))
    small = Engine(EngineConfig(model=str(llama_dir), block_size=4, kv_cache_memory_bytes=4 * probe.runner.bytes_per_block))
    with pytest.raises(ValueError, match=r"exceeds the KV cache capacity \(16 tokens\)"):
        small.add_stage(StageSpec.whole("big", list(range(10)), SamplingParams(max_tokens=10)))


def test_abort_frees_blocks(llm):
    engine = llm.engine
    key = StageKey("a")
    engine.add_stage(StageSpec(key, tuple(_prompts(1, 60, 60, seed=1)[0]), SamplingParams(max_tokens=50, temperature=0.0)))
    engine.step()
    assert engine.load().free_blocks < engine.load().total_blocks
    assert engine.abort(key)
    assert engine.load().free_blocks == engine.load().total_blocks
    assert not engine.has_unfinished()
    assert not engine.abort(key)


def test_unknown_architecture_and_missing_files(tmp_path, llama_dir):
    import json
    import shutil

    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Engine(EngineConfig(model=str(tmp_path)))
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        Engine(EngineConfig(model=str(bad)))
    noweights = tmp_path / "noweights"
    shutil.copytree(llama_dir, noweights)
    for f in noweights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Engine(EngineConfig(model=str(noweights)))
