"""RMSNorm (with its residual add) and rotary embedding on the GPU in Triton, one kernel each.

In plain torch an RMSNorm with its residual add is seven kernels (add, cast, square, mean,
add eps, rsqrt, two products) and rotary on q and k ten more; on the GPU check's H200 a
step of the 8B shape launched ~1,300 kernels, and a step with a prefill chunk spent more time
launching them than running them (the GPU busy 25% of a 512-token step). These are the same
two operations as the compiled CPU kernels (`workers/engine/kernels/fused_elementwise.cpp`),
with the same interface, so the model runner hands the model either (`ModelRunner.set_fused_ops`).

Rounding follows the torch path step by step: the residual sum rounded to the model's dtype;
the norm in float32, rounded to the dtype, then scaled by the weight and rounded again; in
rotary each product rounded, then the sum. Only the mean's summation order differs (a tree
in Triton, torch's own order in torch), as it does in the CPU kernels.

Imported on use (triton: on CUDA, or under `TRITON_INTERPRET=1` in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rotary_inplace"]


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # residual += x (rounded to the dtype, as torch's add_), then normalise the sum
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * norm(x) of each row of x [T, H]; with `residual`, `residual += x` first, in
    place, and the sum normalised (the "add, then norm" between sub-layers)."""
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if tokens == 0:
        return out
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("triton rms_norm needs rows with contiguous elements")
    _rms_norm_kernel[(tokens,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
    )
    return out


@triton.jit
def _round_to_bfloat16(x):
    """x (float32) rounded to the nearest bfloat16, ties to even, as a float32: in integer ops
    (torch's own formula), which the compiler cannot fold away. The first build wrote
    `.to(bfloat16).to(float32)` and on the H200 24% of the outputs differed from torch's: the
    round trips were dropped and the products fused into FMAs, rounding once instead of thrice."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                   num_q_heads, half, HALF_PAD: tl.constexpr, BFLOAT16: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if head < num_q_heads:
        base = q_ptr + token * stride_qt + head * stride_qh
    else:
        base = k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh
    i = tl.arange(0, HALF_PAD)
    ok = i < half
    lo = tl.load(base + i, mask=ok, other=0.0)
    hi = tl.load(base + half + i, mask=ok, other=0.0)
    cos_lo = tl.load(cos_ptr + token * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * stride_ct + half + i, mask=ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * stride_st + i, mask=ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * stride_st + half + i, mask=ok, other=0.0).to(tl.float32)
    lo32 = lo.to(tl.float32)
    hi32 = hi.to(tl.float32)
    # As torch's q * cos + rotate_half(q) * sin: each product rounded to the dtype, then the sum
    # (float32: no rounding; the product of two bfloat16 values is exact in float32).
    if BFLOAT16:
        new_lo = _round_to_bfloat16(_round_to_bfloat16(lo32 * cos_lo) - _round_to_bfloat16(hi32 * sin_lo))
        new_hi = _round_to_bfloat16(_round_to_bfloat16(hi32 * cos_hi) + _round_to_bfloat16(lo32 * sin_hi))
    else:
        new_lo = lo32 * cos_lo - hi32 * sin_lo
        new_hi = hi32 * cos_hi + lo32 * sin_hi
    tl.store(base + i, new_lo.to(lo.dtype), mask=ok)
    tl.store(base + half + i, new_hi.to(lo.dtype), mask=ok)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding (the rotate-half form) in place on q [T, H, D] and k [T, KVH, D]
    (views of the qkv projection's output: any token and head strides, D contiguous), with
    cos and sin [T, 1, D] or [T, D] (the tables' rows of the step's positions)."""
    tokens, num_q_heads, dim = q.shape
    if tokens == 0:
        return
    if q.dtype not in (torch.bfloat16, torch.float32):  # float16: rounding kept torch's only in torch
        q_new, k_new = _torch_rotary(q, k, cos, sin)
        q.copy_(q_new)
        k.copy_(k_new)
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or dim % 2:
        raise ValueError("triton rotary needs an even head_dim with contiguous elements")
    _rotary_kernel[(tokens, num_q_heads + k.shape[1])](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        num_q_heads, dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2), BFLOAT16=q.dtype == torch.bfloat16,
    )


def _torch_rotary(q, k, cos, sin):
    from workers.engine.models.llama import apply_rotary

    return apply_rotary(q, k, (cos, sin))
