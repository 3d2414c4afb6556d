"""Engine output equals transformers' greedy generate, token for token (float32)."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine import LLM, SamplingParams

MAX_NEW = 12


def _hf_greedy(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=model.config.pad_token_id)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def _prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 259) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine_greedy(model_dir, prompts, max_new=MAX_NEW, **options):
    llm = LLM(str(model_dir), **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0))
    return [o.token_ids for o in outs], llm.engine


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    """HF outputs for the prompt sets used below, computed once per architecture."""
    cache: dict = {}

    def get(arch: str, prompts: list[list[int]]):
        key = (arch, tuple(map(tuple, prompts)))
        if key not in cache:
            cache[key] = _hf_greedy(tiny_model_dirs[arch], prompts, MAX_NEW)
        return cache[key]

    return get


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "llama3-tied"]
MIXED = _prompts(16, 1, 90, seed=7)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_requests(arch, tiny_model_dirs, reference):
    prompts = _prompts(3, 1, 40, seed=1)
    for prompt, expected in zip(prompts, reference(arch, prompts)):
        got, _ = _engine_greedy(tiny_model_dirs[arch], [prompt])
        assert got[0] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sixteen_mixed_requests_together(arch, tiny_model_dirs, reference):
    got, engine = _engine_greedy(tiny_model_dirs[arch], MIXED)
    assert got == reference(arch, MIXED)
    from workers.engine import kernels

    # On the CPU the compiled decode kernel serves wherever it builds (make setup builds it).
    assert (engine.runner.decode_kernel is not None) == (kernels.load() is not None)
    assert engine.runner.fused_ops == (kernels.load() is not None)  # RMSNorm, rotary, SiLU·mul fused


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: the sliding window
def test_the_torch_decode_path_gives_the_same_tokens(arch, tiny_model_dirs, reference):
    got, engine = _engine_greedy(tiny_model_dirs[arch], MIXED, attention_backend="sdpa")
    assert engine.runner.decode_kernel is None
    assert got == reference(arch, MIXED)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_small_budget_forces_chunked_prefill(arch, tiny_model_dirs, reference):
    got, engine = _engine_greedy(tiny_model_dirs[arch], MIXED, max_num_batched_tokens=16, block_size=4)
    assert got == reference(arch, MIXED)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shared_prefixes_hit_prefix_cache(arch, tiny_model_dirs, reference):
    shared = _prompts(1, 70, 70, seed=3)[0]
    prompts = [shared + tail for tail in _prompts(6, 1, 20, seed=4)] + [shared]
    llm = LLM(str(tiny_model_dirs[arch]), block_size=8)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    first = llm.generate(prompts[:1], params)  # fills the cache
    rest = llm.generate(prompts[1:], params)
    got = [o.token_ids for o in first + rest]
    assert llm.engine.scheduler.block_manager.prefix_hits_tokens >= 6 * 64
    assert got == reference(arch, prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_small_kv_pool_forces_preemption(arch, tiny_model_dirs, reference):
    # 40 blocks of 4 tokens: enough for any single request, far too few for all 16.
    llm = LLM(str(tiny_model_dirs[arch]), block_size=4, max_num_seqs=16)
    bytes_per_block = llm.engine.runner.bytes_per_block
    got, engine = _engine_greedy(
        tiny_model_dirs[arch], MIXED, block_size=4, max_num_seqs=16, kv_cache_memory_bytes=40 * bytes_per_block
    )
    assert engine.scheduler.num_preemptions > 0
    assert got == reference(arch, MIXED)
