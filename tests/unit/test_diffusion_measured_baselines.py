"""Table 4's baselines as decoding methods of the diffusion cost model (splitserve/core/diffusion_perf.py):
what Sparse-dLLM's and dLLM-Cache's steps compute, and their memory (no measured data needed)."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.core.diffusion import (DiffusionBatch, DiffusionParams, DiffusionSequence, DiffusionWork, Phase,
                                       retained_tokens)
from splitserve.core.diffusion_perf import DiffusionPerfModel, DllmCacheIntervals

PROMPT, GEN, BLOCK = 400, 256, 32
LENGTH = PROMPT + GEN


@pytest.fixture(scope="module")
def perf() -> DiffusionPerfModel:
    return DiffusionPerfModel.preset("L40S", "LLaDA-8B")


def _work(step: int, retention: float = 1.0) -> DiffusionWork:
    params = DiffusionParams(gen_length=GEN, block_length=BLOCK, steps=256, retention_ratio=retention)
    seq = DiffusionSequence("r", PROMPT, params, block=step // 32, step_in_block=step % 32)
    phase = Phase.REFRESH if seq.step_in_block == 0 else Phase.REUSE
    return DiffusionWork(seq, phase, seq.query_tokens("dual"), admitted=False)


def _shape(perf, step: int, method: str, retention: float = 1.0, **options):
    shapes = perf.entry_shapes(_work(step, retention), method=method, full_sequence_logits=True, **options)
    assert len(shapes) == 1
    return shapes[0]


def test_dual_cache_is_the_fast_dllm_loop(perf):
    refresh, reuse = _shape(perf, 32, "dual"), _shape(perf, 33, "dual")
    assert (refresh.query_tokens, refresh.context, refresh.logit_rows, refresh.kv_write) == (LENGTH, 0, LENGTH, LENGTH)
    assert (reuse.query_tokens, reuse.context, reuse.logit_rows, reuse.kv_read) == (BLOCK, LENGTH - BLOCK, BLOCK,
                                                                                    LENGTH - BLOCK)


def test_sparse_dllm_runs_two_full_forwards_per_block_then_the_retained_context(perf):
    first, second, rest = (_shape(perf, s, "sparse_dllm", 0.5) for s in (64, 65, 66))
    assert first.full and first.query_tokens == LENGTH and first.kv_write == 0 and first.logit_rows == LENGTH
    assert second.full and second.query_tokens == LENGTH and second.kv_write == LENGTH  # cached, then evicted
    kept = retained_tokens(LENGTH - BLOCK, 0.5)
    assert (rest.query_tokens, rest.context, rest.logit_rows, rest.kv_read) == (BLOCK, kept, BLOCK, kept)
    per_block = [_shape(perf, 64 + i, "sparse_dllm", 0.5) for i in range(32)]
    assert sum(s.full for s in per_block) == 2


def test_dllm_cache_refreshes_on_its_intervals(perf):
    knobs = DllmCacheIntervals()  # Table 3: prompt every 100 steps, response every 7; rho 0.25
    full = _shape(perf, 0, "dllm_cache")
    gen = _shape(perf, 7, "dllm_cache")
    prompt = _shape(perf, 100, "dllm_cache")
    partial = _shape(perf, 1, "dllm_cache")
    chosen = int(GEN * knobs.transfer_ratio)
    assert full.full and full.query_tokens == LENGTH
    assert (gen.query_tokens, gen.context) == (GEN, PROMPT)  # the response against the cached prompt
    assert (prompt.query_tokens, prompt.context) == (PROMPT + chosen, GEN - chosen)
    assert (partial.query_tokens, partial.context) == (chosen, LENGTH - chosen)
    v = perf.value_projection_fraction
    assert 0.05 < v < 0.1 and partial.extra_linear_tokens == pytest.approx(v * GEN)
    assert {s.logit_rows for s in (full, gen, prompt, partial)} == {LENGTH}  # its LM head sees every position
    # 1 full, 36 response refreshes (7, 14, ..., 252), 2 prompt refreshes (100, 200), 217 partial steps.
    kinds = [_shape(perf, s, "dllm_cache").query_tokens for s in range(256)]
    assert kinds.count(LENGTH) == 1 and kinds.count(GEN) == 36 and kinds.count(PROMPT + chosen) == 2
    assert kinds.count(chosen) == 217


def test_the_baselines_compute_more_than_the_dual_cache_per_request(perf):
    def request_flops(method: str, retention: float = 1.0) -> float:
        return sum(perf.step_cost(DiffusionBatch([_work(s, retention)]), method=method,
                                  full_sequence_logits=True).flops for s in range(256))

    dual = request_flops("dual")
    assert request_flops("sparse_dllm", 0.5) > 1.3 * dual  # 16 full forwards instead of 8
    assert request_flops("dllm_cache") > 1.5 * dual  # 84+ tokens a step, its LM head over all 656 positions


def test_dllm_caches_feature_cache_is_twice_the_kv(perf):
    assert perf.feature_cache_bytes_per_token == 2 * perf.kv_bytes_per_token  # MHA: K, V + attention + MLP
    cached = dataclasses.replace(perf, cache_bytes_per_token=perf.feature_cache_bytes_per_token)
    assert cached.kv_bytes_per_token == 2 * perf.kv_bytes_per_token
    assert cached.largest_static_batch(1280).static_batch_size < perf.largest_static_batch(1280).static_batch_size


def test_a_sparse_cache_fits_a_larger_static_batch(perf):
    kept = retained_tokens(1280 - BLOCK, 0.5)
    sparse = perf.largest_static_batch(1280, kv_tokens_per_request=kept)
    dense = perf.largest_static_batch(1280)
    assert sparse.static_batch_size >= dense.static_batch_size
    assert sparse.kv_pool_bytes == sparse.static_batch_size * kept * perf.kv_bytes_per_token
    assert perf.static_fits(sparse.static_batch_size, 1280, kv_tokens_per_request=kept)
    assert not perf.static_fits(sparse.static_batch_size + 1, 1280, kv_tokens_per_request=kept)


def test_unknown_methods_and_intervals_are_refused(perf):
    with pytest.raises(ValueError, match="method"):
        perf.step_cost(DiffusionBatch([_work(0)]), method="dkv_cache")
    with pytest.raises(ValueError, match="gen_interval"):
        DllmCacheIntervals(gen_interval=0)
    with pytest.raises(ValueError, match="transfer_ratio"):
        DllmCacheIntervals(transfer_ratio=1.5)
