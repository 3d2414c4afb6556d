"""Paged decode attention on the GPU in Triton: keys and values read in place from the paged KV cache.

Without flash-attn (it cannot be installed without CUDA's toolchain at build time, and the
GPU check's machine has none) the torch path of a decode step gathers every sequence's
blocks into a contiguous copy (`k_cache[tables]`), then runs SDPA over it: the KV is read,
written and read again. On the GPU check's H200 (Llama-3-8B shape, 64 decodes at context
4,096) that was 18.5 ms of gathers and 10.9 ms of attention per step where reading the KV
once takes about 7 ms. This kernel reads each key and value once, from where it lies.

One program per (sequence, KV head): its G = H / KVH query heads (GQA) walk the sequence's
context in tiles of `TILE` tokens, each token's cache block looked up in the block table,
with an online softmax (running max and sum) in float32; the two products (q·K, p·V) on
tensor cores with the G heads padded to 16 rows. Same signature as the CPU kernel
(`workers/engine/kernels/paged_decode_attention.cpp`), so `AttentionMetadata.decode_kernel`
takes either; it reads no value back on the host, so a decode step captured as a CUDA graph
(`EngineConfig.decode_graphs`) records it.

Triton is imported on use: the engine imports this module only when triton is importable and
the device is CUDA, or under `TRITON_INTERPRET=1` (Triton's interpreter runs the same kernel
on CPU tensors with numpy: how the tests check it here against SDPA, token for token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["paged_decode_attention", "unsupported"]

TILE = 64  # context tokens per loop iteration (several cache blocks)


def unsupported(head_dim: int, use_dot: bool = True) -> str | None:
    """What this kernel needs that a head_dim lacks (tl.arange: a power of two; tl.dot: >= 16), or None."""
    if head_dim & (head_dim - 1) or (use_dot and head_dim < 16):
        return f"a power-of-two head_dim of at least 16, not {head_dim}" if use_dot else \
            f"a power-of-two head_dim, not {head_dim}"
    return None


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
    scale, window,
    stride_qb, stride_qh,
    stride_kblock, stride_kslot, stride_khead,
    stride_vblock, stride_vslot, stride_vhead,
    stride_ob, stride_oh,
    stride_tb,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE_TOKENS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = tl.arange(0, GROUP_PAD)
    head_ok = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_heads = kv_head * GROUP + heads
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0)  # [G, D], the cache's dtype
    context = tl.load(lens_ptr + seq).to(tl.int32)
    # A sliding window sees the last `window` keys only (Mistral); 0: the whole context.
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    tokens = tl.arange(0, TILE_TOKENS)
    start = (first // TILE_TOKENS) * TILE_TOKENS
    for tile in range(start, context, TILE_TOKENS):
        pos = tile + tokens
        ok = (pos < context) & (pos >= first)
        block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=ok, other=0)
        slot = pos % BLOCK_SIZE
        k = tl.load(k_ptr + block[:, None] * stride_kblock + slot[:, None] * stride_kslot
                    + kv_head * stride_khead + dims[None, :], mask=ok[:, None], other=0.0)  # [T, D]
        v = tl.load(v_ptr + block[:, None] * stride_vblock + slot[:, None] * stride_vslot
                    + kv_head * stride_vhead + dims[None, :], mask=ok[:, None], other=0.0)
        if USE_DOT:  # tensor cores: the G query heads padded to 16 rows (memory-bound: the pad is free)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
        else:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G, T]
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:  # p in the cache's dtype for the second product, as flash attention does
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int = 0, use_dot: bool = True) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, H, D], over its first
    `context_lens[b]` cached keys (its own included: written before), read through
    `block_tables` [B, K] from caches laid out [blocks, block_size, kv_heads, D]
    (strided views of the engine's cache are fine: the last dimension must be contiguous).
    `use_dot`: the two products on tensor cores (`tl.dot`; float32 at IEEE precision, not
    TF32); False: as elementwise sums in float32 (the fallback measured beside it)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    why = unsupported(head_dim, use_dot)
    if why is not None:
        raise ValueError(f"triton decode attention needs {why}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("triton decode attention needs the head dimension contiguous")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, out, tables, context_lens,
        float(scale), int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)) if use_dot else max(1, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, TILE_TOKENS=TILE, USE_DOT=use_dot, IEEE=q.dtype == torch.float32,
    )
    return out
