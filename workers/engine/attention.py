"""Paged attention over the KV cache, with its metadata passed explicitly.

Two backends: flash-attn varlen with a block table (CUDA, when `flash_attn` imports and
the block size suits it) and torch `scaled_dot_product_attention` (CPU, or CUDA
without flash-attn). Decode tokens may instead go to a paged decode kernel that reads the
cache in place (`decode_kernel`: the compiled CPU one, or the Triton one on CUDA,
`workers/engine/triton_attention.py`). The flattened batch puts decode tokens first, then
prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

try:  # optional extra: only installs with CUDA
    from flash_attn import flash_attn_varlen_func  # type: ignore

    HAVE_FLASH_ATTN = True
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = None
    HAVE_FLASH_ATTN = False

FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn's paged-KV kernels need page sizes of 256k


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flattened batch."""

    query_start: int  # offset of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens with KV after this step, chunk included
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch; built by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) of each new token
    slot_blocks: torch.Tensor  # [num_tokens] int64: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] int64: slot_mapping % block_size
    num_decode_tokens: int  # the first tokens of the batch, one per decoding sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    prefills: list[PrefillChunk]
    block_size: int
    # flash-attn varlen inputs (CUDA only); None on the SDPA path.
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_query_len: int = 0
    max_context_len: int = 0
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32, batch order
    # The paged decode kernel (CPU: workers/engine/kernels; CUDA: triton_attention), or None:
    # torch SDPA over gathered KV.
    decode_kernel: Callable | None = None


@dataclass
class BucketMetadata:
    """Attention inputs of a step padded to a captured shape (LAPS §3.1): B rows of L tokens.

    Every tensor has a shape fixed by the bucket `(L, B, K)` alone and no field is a Python
    value read from the batch, so the same forward can be captured once as a CUDA graph and
    replayed with new contents in the same buffers (`workers/engine/captured_shapes.py`).
    Row b holds one request's chunk right-padded to L tokens; its queries sit at positions
    `query_starts[b] + i` and see the row's keys at positions `< context_lens[b]` (causally);
    its keys are the K blocks of `block_tables[b]`, this step's KV included (written first)."""

    slot_blocks: torch.Tensor  # [B*L] int64: cache block of each token's KV (pads: the scratch block)
    slot_offsets: torch.Tensor  # [B*L] int64
    block_tables: torch.Tensor  # [B, K] int64 (pad entries: the scratch block)
    context_lens: torch.Tensor  # [B] int64: keys with KV after this step, per row
    query_starts: torch.Tensor  # [B] int64: position of each row's first query token
    block_size: int
    # A bucket of one token per row (a decode graph) runs this paged decode kernel when set
    # (as `AttentionMetadata.decode_kernel`): no gathered copy of the KV, and it reads no
    # value on the host, so a graph records it.
    decode_kernel: Callable | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's keys/values at their slots. Caches are [blocks, block_size, kv_heads, dim] views."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    use_flash: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over cached + new KV; returns [T, H, D].

    `sliding_window` W lets a query at position i see keys in (i - W, i] (Mistral).
    """
    if isinstance(meta, BucketMetadata):
        return bucket_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    write_kv(k_cache, v_cache, k, v, meta)
    if use_flash:
        return flash_attn_varlen_func(
            q, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_context_len,
            softmax_scale=scale, causal=True, block_table=meta.block_tables,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        )
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd and meta.decode_kernel is not None:  # in place from the paged cache: no KV copy
        out[:nd] = meta.decode_kernel(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                      scale, sliding_window or 0)
    elif nd:
        out[:nd] = _sdpa_decode(q[:nd], k_cache, v_cache, meta, sliding_window, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.context_len == chunk.query_len:
            keys, values = k[rows], v[rows]  # no earlier KV: use this step's directly
        else:
            keys = _gather(k_cache, chunk.block_table, chunk.context_len)
            values = _gather(v_cache, chunk.block_table, chunk.context_len)
        out[rows] = _sdpa_prefill(q[rows], keys, values, chunk, sliding_window, scale)
    return out


def bucket_attention(q, k, v, k_cache, v_cache, meta: BucketMetadata, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Attention of a padded step [B*L] in one batched call with static shapes: write the
    step's KV, gather each row's K blocks, mask to the row's causal context.

    Every op keeps its shape from the bucket alone and none reads a tensor on the host, so
    CUDA graph capture can record it. Pad queries (past a row's chunk) see the row's keys
    and their output is never read; pad rows see their scratch keys."""
    _write_bucket_kv(k_cache, v_cache, k, v, meta)
    batch, blocks = meta.block_tables.shape
    tokens = q.shape[0] // batch
    if tokens == 1 and meta.decode_kernel is not None:
        return meta.decode_kernel(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, sliding_window or 0)
    _, num_heads, head_dim = q.shape
    keys = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)  # [B, KVH, K*bs, D]
    values = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    key_pos = torch.arange(blocks * meta.block_size, device=q.device)[None, None, :]
    query_pos = (meta.query_starts[:, None] + torch.arange(tokens, device=q.device)[None, :])[:, :, None]
    allowed = (key_pos <= query_pos) & (key_pos < meta.context_lens[:, None, None])  # [B, L, S]
    if sliding_window:
        allowed &= key_pos > query_pos - sliding_window
    # Each kv head's G query heads ride as G·L query rows (as in `_sdpa_decode`): no
    # masked-GQA path, one SDPA call for the whole bucket.
    grouped = q.view(batch, tokens, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, num_kv_heads, group * tokens, head_dim)
    mask = allowed[:, None, None].expand(batch, 1, group, tokens, allowed.shape[-1]).reshape(batch, 1, group * tokens, -1)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    out = out.view(batch, num_kv_heads, group, tokens, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch * tokens, num_heads, head_dim)


@torch.compiler.disable
def _write_bucket_kv(k_cache, v_cache, k, v, meta: BucketMetadata) -> None:
    # Outside a `torch.compile`d bucket (a graph break): functionalising an index_put into a
    # strided view of the whole KV cache fails in the compiler; CUDA graph capture records it.
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    return cache[block_table].flatten(0, 1)[:length]


def _sdpa_decode(q, k_cache, v_cache, meta: AttentionMetadata, sliding_window: int | None, scale: float) -> torch.Tensor:
    # All decoding sequences in one call: keys padded to the longest context, masked.
    # Each kv head's G query heads ride as G query rows ([B, KVH, G, D]) instead of
    # enable_gqa: on CPU that avoids SDPA's slow masked-GQA path (4-5x in bfloat16).
    tables = meta.decode_block_tables
    batch, num_heads, head_dim = q.shape
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, KVH, S, D]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    num_kv_heads = keys.shape[1]
    key_pos = torch.arange(keys.shape[2], device=q.device)
    lens = meta.decode_context_lens[:, None]
    allowed = key_pos[None, :] < lens
    if sliding_window:
        allowed &= key_pos[None, :] >= lens - sliding_window
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=allowed[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _sdpa_prefill(q, keys, values, chunk: PrefillChunk, sliding_window: int | None, scale: float) -> torch.Tensor:
    q_ = q.transpose(0, 1)[None]  # [1, H, Lq, D]
    k_ = keys.transpose(0, 1)[None]
    v_ = values.transpose(0, 1)[None]
    offset = chunk.context_len - chunk.query_len
    if offset == 0 and not sliding_window:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(offset, chunk.context_len, device=q.device)[:, None]
        k_pos = torch.arange(chunk.context_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
