"""The diffusion engine (dLLM-Serve) on a random LLaDA: token for token against the reference.

With no cache the engine must reproduce `reference.generate` (full recompute every step);
with the dual cache, `reference.generate_dual_cache` (Refresh at each block start, Reuse
within) — both through continuous, packed, phase-multiplexed batches of prompts of
different lengths, with the logits decomposed into chunks smaller than one block."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.core.diffusion import DiffusionParams
from splitserve.cli.demo_model import DemoModelSpec, build_demo_model
from workers.diffusion.reference import generate, generate_dual_cache
from workers.diffusion.runner import select_context
from workers.engine import LLM, SamplingParams
from workers.engine.models.llada import load_llada

TINY = dict(arch="llada", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
            vocab_size=300, max_position_embeddings=96, seed=3, initializer_range=0.2)
SEEDS = (11, 12, 13, 14)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    return build_demo_model(DemoModelSpec(**TINY), tmp_path_factory.mktemp("llada-engine"))


@pytest.fixture(scope="module")
def model(llada_dir):
    return load_llada(llada_dir)


def _prompts(lengths) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _run(llada_dir, prompts, knobs: DiffusionParams, **engine):
    llm = LLM(str(llada_dir), **engine)
    params = [SamplingParams(max_tokens=knobs.gen_length, block_length=knobs.block_length, steps=knobs.steps,
                             temperature=knobs.temperature, remasking=knobs.remasking, seed=seed, ignore_eos=True)
              for seed in SEEDS[: len(prompts)]]
    return llm, [list(o.token_ids) for o in llm.generate(prompts, params)]


CASES = [  # gen_length, block_length, steps, remasking, temperature
    (16, 8, 8, "low_confidence", 0.0),
    (16, 16, 16, "low_confidence", 0.0),
    (12, 4, 12, "random", 0.0),
    (16, 4, 8, "low_confidence", 0.8),
]


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_engine_equals_the_reference_token_for_token(llada_dir, model, cache, case):
    gen, block, steps, remasking, temperature = case
    knobs = DiffusionParams(gen_length=gen, block_length=block, steps=steps, remasking=remasking,
                            temperature=temperature)
    prompts = _prompts([5, 13, 9, 31])  # lengths that are multiples of nothing in particular
    reference = generate if cache == "none" else generate_dual_cache
    expected = reference(model, prompts, knobs, mask_token_id=model.config.mask_token_id,
                         generators=[torch.Generator().manual_seed(s) for s in SEEDS])
    # A small step budget so requests join and leave mid-way, logits in chunks below a block.
    llm, got = _run(llada_dir, prompts, knobs, dllm_cache=cache, max_num_logits=5,
                    max_num_batched_tokens=2 * (31 + gen))
    assert got == [list(e.tokens) for e in expected]
    assert llm.engine.runner.peak_logit_rows <= 5


GUIDED = [  # cfg_scale, remasking, temperature: guided and unguided requests in the same batches
    (0.5, "random", 0.0),
    (0.0, "low_confidence", 0.0),
    (1.5, "low_confidence", 0.0),
    (2.0, "low_confidence", 0.8),
]


def test_classifier_free_guidance_equals_the_reference(llada_dir, model):
    prompts = _prompts([5, 13, 9, 21])
    knobs = [DiffusionParams(gen_length=12, block_length=4, steps=6, cfg_scale=scale, remasking=remasking,
                             temperature=temperature) for scale, remasking, temperature in GUIDED]
    expected = [generate(model, [prompt], k, mask_token_id=model.config.mask_token_id,
                         generators=[torch.Generator().manual_seed(seed)])[0].tokens
                for prompt, k, seed in zip(prompts, knobs, SEEDS)]
    # Logits in chunks of 5 rows: a guided request's 4-row block costs 8, so its rows split.
    llm = LLM(str(llada_dir), dllm_cache="none", max_num_logits=5, max_num_batched_tokens=2 * (21 + 12) + 25)
    params = [SamplingParams(max_tokens=12, block_length=4, steps=6, cfg_scale=k.cfg_scale, remasking=k.remasking,
                             temperature=k.temperature, seed=seed, ignore_eos=True) for k, seed in zip(knobs, SEEDS)]
    got = [list(o.token_ids) for o in llm.generate(prompts, params)]
    assert got == [list(e) for e in expected]
    assert llm.engine.runner.peak_logit_rows <= 5
    # Guidance is applied: the guided greedy requests decode otherwise without it.
    unguided = generate(model, [prompts[2]], DiffusionParams(gen_length=12, block_length=4, steps=6),
                        mask_token_id=model.config.mask_token_id)
    assert got[2] != list(unguided[0].tokens)
    with pytest.raises(ValueError, match="cfg_scale"):  # the dual cache has no unconditional pass
        LLM(str(llada_dir)).generate([prompts[0]], SamplingParams(max_tokens=12, cfg_scale=0.5))


def test_phase_multiplexing_admits_requests_mid_flight_and_changes_no_token(llada_dir):
    knobs = DiffusionParams(gen_length=16, block_length=4, steps=8)
    prompts = _prompts([7, 20, 11, 3])
    multiplexed, by_phase = _run(llada_dir, prompts, knobs, max_num_batched_tokens=60)
    static, by_request = _run(llada_dir, prompts, knobs, diffusion_policy="static", static_batch_size=2,
                              max_num_batched_tokens=60)
    assert by_phase == by_request
    assert multiplexed.engine.scheduler.config.policy == "phase_multiplexed"


def test_output_stops_at_the_first_eos_of_a_final_block(llada_dir, model):
    knobs = DiffusionParams(gen_length=16, block_length=4, steps=8)
    prompts = _prompts([6, 10])
    _, full = _run(llada_dir, prompts, knobs)
    eos = full[0][5]  # pretend the 6th generated token ends the sequence
    llm = LLM(str(llada_dir))
    outs = llm.generate(prompts, [SamplingParams(max_tokens=16, block_length=4, steps=8, temperature=0.0,
                                                 stop_token_ids=[eos])] * 2)
    for out, tokens in zip(outs, full):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert out.token_ids == tokens[:cut]
        assert out.finish_reason == ("stop" if eos in tokens else "length")
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.runner.states


def test_bad_diffusion_parameters_are_refused_naming_the_field(llada_dir):
    llm = LLM(str(llada_dir))
    for params, name in ((SamplingParams(max_tokens=10, block_length=4), "block_length"),
                         (SamplingParams(max_tokens=8, block_length=4, steps=3), "steps"),
                         (SamplingParams(max_tokens=8, remasking="entropy"), "remasking"),
                         (SamplingParams(max_tokens=8, retention_ratio=0.0), "retention_ratio"),
                         (SamplingParams(max_tokens=8, top_k=5), "top_k"),
                         (SamplingParams(max_tokens=96), "max_model_len")):
        with pytest.raises(ValueError, match=name):
            llm.generate([[5, 6, 7]], params)
    with pytest.raises(ValueError, match="mask token"):
        llm.generate([[5, llm.engine.model_config.mask_token_id]], SamplingParams(max_tokens=8))


def test_sparse_kv_keeps_each_heads_own_top_positions_or_one_shared_set():
    scores = torch.tensor([[9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0],
                           [0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0]])
    # Max-pooled over 3 positions: head 0 peaks around 0-1 and 6-7, head 1 around 2-4.
    assert select_context(scores, 2, "head").tolist() == [[0, 1], [2, 3]]
    shared = select_context(scores, 2, "uniform")
    assert shared.tolist() == [[0, 1], [0, 1]]  # one set for every head: head 1's only token is lost
    with pytest.raises(ValueError, match="sparse_kv"):
        select_context(scores, 2, "random")


@pytest.mark.parametrize("selection", ["head", "uniform"])
def test_a_sparse_cache_keeping_all_context_gives_the_dense_tokens_and_low_retention_runs(llada_dir, selection):
    knobs = DiffusionParams(gen_length=16, block_length=4, steps=8)
    prompts = _prompts([9, 14])
    _, dense = _run(llada_dir, prompts, knobs)
    llm = LLM(str(llada_dir), sparse_kv=selection)
    keep_all = llm.generate(prompts, SamplingParams(max_tokens=16, block_length=4, steps=8, temperature=0.0,
                                                    retention_ratio=0.9999, ignore_eos=True))
    assert [o.token_ids for o in keep_all] == dense  # k = the whole context: the same attention
    low = llm.generate(prompts, SamplingParams(max_tokens=16, block_length=4, steps=8, temperature=0.0,
                                               retention_ratio=0.25, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in low)
    assert llm.engine.scheduler.kv_used_tokens == 0


def test_on_the_trained_model_head_centric_sparse_kv_keeps_more_answers_than_uniform():
    """dLLM-Serve §4.5 on the repository's tiny model (digit reversal): at a low retention
    ratio the per-head selection keeps the keys each head needs; one shared set does not."""
    from pathlib import Path

    from workers.diffusion import tiny_task

    model_dir = Path(__file__).resolve().parents[2] / "workers" / "diffusion" / "tiny_model"
    problems = tiny_task.problems(50, seed=777)
    accuracy = {}
    for selection in ("head", "uniform"):
        llm = LLM(str(model_dir), sparse_kv=selection, max_num_batched_tokens=4096)
        outs = llm.generate([list(p.prompt_ids) for p in problems],
                            SamplingParams(max_tokens=tiny_task.GEN_LENGTH, block_length=4, steps=16, temperature=0.0,
                                           retention_ratio=0.35, ignore_eos=True))
        accuracy[selection] = tiny_task.accuracy([o.token_ids for o in outs], problems)
    assert accuracy["head"] >= accuracy["uniform"] + 0.2, accuracy


# ---- the worker service's interface -----------------------------------------------------------

def _stage(key, prompt, max_tokens=8, **fields):
    from splitserve.core import StageSpec

    return StageSpec(key, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, block_length=4,
                                                        steps=8, ignore_eos=True), **fields)


def test_engine_serves_whole_stages_and_refuses_split_or_kv(llada_dir):
    from splitserve.core import KvInBlocks, KvSink, StageKey
    from splitserve.core.sequence import SessionHold
    from workers.diffusion.engine import DiffusionEngine
    from workers.engine.config import EngineConfig

    engine = DiffusionEngine(EngineConfig(model=str(llada_dir), kv_cache_memory_bytes=1 << 20, detokenize=False))
    assert engine.engine_kind == "llada"
    prompt = _prompts([5])[0]
    refusals = {
        "kv_sources": dict(kv=KvInBlocks((0,), 4)),
        "kv_sink": dict(sink=KvSink("w", "t", (1,), 4, 0)),
        "generated_token_ids": dict(output_ids=(7,)),
        "keep_kv": dict(keep_kv=True),
        "session": dict(session=SessionHold("s", 60.0, 0)),
        "end": dict(end=6),
    }
    for i, (field, extra) in enumerate(refusals.items()):
        with pytest.raises(ValueError, match=field):
            engine.add_stage(_stage(StageKey(f"bad-{i}", 0), prompt, **extra))
    assert not engine.has_unfinished()

    engine.add_stage(_stage(StageKey("a", 0), prompt, end=len(prompt) + 8))  # the whole range is fine
    engine.add_stage(_stage(StageKey("b", 0), prompt))
    with pytest.raises(ValueError, match="already running"):
        engine.add_stage(_stage(StageKey("b", 0), prompt))
    load = engine.load()
    assert (load.engine_kind, load.waiting, load.block_size) == ("llada", 2, 1)
    events = engine.step()  # both admitted; a Refresh each, no block final yet
    assert events == [] and engine.last_step_tokens == 2 * (len(prompt) + 8)
    load = engine.load()
    assert load.running == 2 and load.free_blocks == load.total_blocks - 2 * (len(prompt) + 8)
    assert engine.stage_keys("a") == [StageKey("a", 0)] and engine.progress(StageKey("a", 0)) is None
    while not events:
        events = engine.step()
    assert {e.key for e in events} == {StageKey("a", 0), StageKey("b", 0)}
    assert all(len(e.token_ids) == 4 and e.text == "" and e.finish_reason is None for e in events)
    aborted = engine.abort_all()
    assert {(e.key, e.finish_reason, e.num_output_tokens) for e in aborted} == \
        {(StageKey("a", 0), "abort", 4), (StageKey("b", 0), "abort", 4)}
    assert not engine.has_unfinished() and engine.load().free_blocks == engine.load().total_blocks


def test_the_profile_step_runs_the_worst_batch_with_logits_bounded(llada_dir):
    """The logit-aware profiler's dummy workload (§4.2) runs through the real runner (on CUDA the
    allocator's peak is read around it); its logits never exceed max_num_logits rows at once."""
    from splitserve.core.diffusion import profile_batch
    from workers.diffusion.engine import DiffusionEngine, kv_pool_bytes
    from workers.engine.config import EngineConfig

    engine = DiffusionEngine(EngineConfig(model=str(llada_dir), max_num_batched_tokens=200, max_num_logits=7,
                                          kv_cache_memory_bytes=1 << 20))
    batch = profile_batch(200, engine.max_model_len, 7)
    assert batch.num_query_tokens == 200 and all(e.seq.length <= engine.max_model_len for e in batch.entries)
    assert batch.num_logit_rows >= 7  # a step's worst logit peak is reached
    wide = profile_batch(200, engine.max_model_len, 150)  # many logit rows: blocks span the sequences
    assert wide.num_logit_rows >= 150 and wide.num_query_tokens == 200
    engine.run_profile_step()
    assert engine.runner.peak_logit_rows == 7 and not engine.runner.states
    assert engine.runner.cache == "dual"  # stored no KV while profiling, and restored
    # 48 GB at 0.9, 1 GB held elsewhere, 16 GB of weights, a 2 GB activation peak (+5% guard).
    gb = 10**9
    assert kv_pool_bytes(48 * gb, 0.9, 1 * gb, 16 * gb, 2 * gb) == int(43.2 * gb - 17 * gb - 2.1 * gb)
    assert kv_pool_bytes(24 * gb, 0.9, 0, 16 * gb, 8 * gb) == 0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_pool_bytes(gb, 0.0, 0, 0, 0)
