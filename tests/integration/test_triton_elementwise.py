"""The Triton RMSNorm and rotary kernels (workers/engine/triton_elementwise.py) against the
model's torch path, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before
triton is imported). Needs triton, which the CPU install does not bring (a GPU machine has it:
there `scripts/gpu_check.sh` runs them compiled, in the engine, token for token); skipped without."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from workers.engine import triton_elementwise  # noqa: E402
from workers.engine.models.llama import RMSNorm, apply_rotary  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - triton imported earlier without it
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

# float32: only the mean's summation order differs from torch. bfloat16: Triton's interpreter
# rounds float32 to bfloat16 by truncation where the GPU (and torch) round to nearest even, so
# here results may differ by a unit in the last place; bit for bit is checked on the GPU
# (`scripts/gpu_check.sh`, sub-check profile, `elementwise`).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2 ** -5, rtol=2 ** -6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_the_torch_path_and_updates_the_residual(dtype, with_residual, hidden):
    gen = torch.Generator().manual_seed(hidden + with_residual)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype) if with_residual else None
    ref_residual = residual.clone() if with_residual else None
    with torch.inference_mode():
        expected = norm(x.clone(), ref_residual)
        got = triton_elementwise.rms_norm(x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    if with_residual and dtype == torch.float32:
        assert torch.equal(residual, ref_residual)  # the sum, rounded as torch's add_ rounds it
    elif with_residual:
        torch.testing.assert_close(residual, ref_residual, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rotary_in_place_matches_the_torch_path_on_views_of_the_qkv_output(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 5, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2, generator=gen) * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    expected_q, expected_k = apply_rotary(q.clone(), k.clone(), (cos, sin))
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    triton_elementwise.rotary_inplace(q, k, cos, sin)
    # Same rounding, in integer ops for bfloat16 (exact in the interpreter too): bit for bit.
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched
