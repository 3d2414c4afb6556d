"""The compiled fused elementwise ops equal the torch ops they replace in the decoder layer.

RMSNorm (alone, and with the residual add fused in, the residual updated in place) and rotary
(in place on strided q and k views of one qkv projection), over random shapes
and rows counts on both sides of the threading threshold, float32 and bfloat16; then the
whole model: the same logits with and without them. Skipped with the reason where the
kernels cannot be built (the engine then keeps the torch ops).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine import kernels
from workers.engine.models.llama import RMSNorm, apply_rotary

MODULE = kernels.load()
pytestmark = pytest.mark.skipif(MODULE is None, reason="the CPU kernels could not be built here (no compiler?)")

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# bfloat16 rounds at 2^-8 relative; the kernels compute in float32 and round where torch does.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _randn(gen, *shape, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * 2).to(dtype)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.sampled_from([8, 64, 576, 1000]), DTYPES, st.booleans(), st.integers(0, 2**31))
def test_rms_norm_with_and_without_the_residual_add(rows, dim, dtype, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(gen, dim, dtype=dtype))
    x, residual = _randn(gen, rows, dim, dtype=dtype), _randn(gen, rows, dim, dtype=dtype)
    expected_residual = residual.clone() if with_residual else None
    expected = norm(x, expected_residual)  # the torch ops (fused is unset on the class)
    got_residual = residual.clone() if with_residual else None
    x_before = x.clone()
    got = MODULE.rms_norm(x, norm.weight.detach(), 1e-5, got_residual)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    if with_residual:
        assert torch.equal(got_residual, expected_residual)  # the same one rounding of x + residual
    assert torch.equal(x, x_before)  # x itself untouched


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.sampled_from([(9, 3, 64), (4, 4, 32), (8, 2, 128)]), DTYPES, st.integers(0, 2**31))
def test_rotary_in_place_on_views_of_the_qkv_projection(tokens, heads, dtype, seed):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    qkv = _randn(gen, tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)[:, None, :]

    def views(t):
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v

    q, k, _ = views(qkv.clone())
    expected_q, expected_k = apply_rotary(q, k, (cos, sin))
    fused_qkv = qkv.clone()
    q, k, v = views(fused_qkv)
    got_q, got_k = apply_rotary(q, k, (cos, sin), MODULE)
    torch.testing.assert_close(got_q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(got_k, expected_k, **TOLERANCE[dtype])
    assert got_q.data_ptr() == fused_qkv.data_ptr()  # in place, in the projection's output
    assert torch.equal(v, views(qkv)[2])  # v untouched


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    with pytest.raises(RuntimeError, match="weight"):
        MODULE.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5, None)
    with pytest.raises(RuntimeError, match="residual"):
        MODULE.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-5, torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="cos, sin"):
        MODULE.rotary_inplace(torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(3, 8), torch.zeros(3, 8))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_the_engine_gives_the_same_tokens_with_and_without_the_fused_ops(arch, tiny_model_dirs):
    import random

    from workers.engine import LLM, SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(259) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    llm = LLM(str(tiny_model_dirs[arch]))
    assert llm.engine.runner.fused_ops  # on by default where the kernels built
    params = SamplingParams(max_tokens=10, temperature=0.0)
    fused = [o.token_ids for o in llm.generate(prompts, params)]
    assert not llm.engine.runner.set_fused_ops(False) and not llm.engine.runner.fused_ops
    switched = [m for m in llm.engine.runner.model.modules() if hasattr(m, "fused")]
    assert switched and all(m.fused is None for m in switched)  # every RMSNorm and rotary back on torch
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert fused == plain


def test_an_empty_step_and_overlapping_residual_rows():
    empty = torch.zeros(0, 4, 8)
    MODULE.rotary_inplace(empty, torch.zeros(0, 2, 8), torch.zeros(0, 1, 8), torch.zeros(0, 1, 8))  # no error
    broadcast = torch.zeros(1, 8).expand(3, 8)  # stride 0: three rows in one place
    with pytest.raises(RuntimeError, match="not overlapping"):
        MODULE.rms_norm(torch.zeros(3, 8), torch.ones(8), 1e-5, broadcast)
