"""The Triton paged decode kernel (workers/engine/triton_attention.py) against torch SDPA over
the gathered KV, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before
triton is imported). Needs triton, which the CPU install does not bring (a GPU machine has
it: there `scripts/gpu_check.sh` runs the kernel compiled, token for token); skipped without."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from workers.engine.attention import AttentionMetadata, _sdpa_decode  # noqa: E402
from workers.engine.triton_attention import paged_decode_attention  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - triton imported earlier without it
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)


def _reference(q, k_cache, v_cache, tables, lens, window, scale):
    meta = AttentionMetadata(slot_mapping=None, slot_blocks=None, slot_offsets=None, num_decode_tokens=q.shape[0],
                             decode_block_tables=tables, decode_context_lens=lens, prefills=[], block_size=k_cache.shape[1])
    return _sdpa_decode(q, k_cache, v_cache, meta, window or None, scale)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2), (4, 4), (7, 1)])
@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize("use_dot", [True, False])
def test_it_matches_sdpa_over_the_gathered_cache(heads, kv_heads, window, use_dot):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads + window)
    blocks, block_size, head_dim = 24, 16, 32
    # The engine's layout: [blocks, layers, k/v, block_size, kv_heads, D]; one layer's views are strided.
    cache = torch.randn(blocks, 2, 2, block_size, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = cache[:, 1].unbind(1)
    lens = torch.tensor([1, 16, 17, 70, 33])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:5] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.17, window, use_dot)
    ref = _reference(q, k_cache, v_cache, tables, lens, window, 0.17)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_pad_columns_of_the_block_table_past_the_context_are_never_read():
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(8, 1, 2, 16, 2, 16, generator=gen)
    k_cache, v_cache = cache[:, 0].unbind(1)
    lens = torch.tensor([20])
    q = torch.randn(1, 4, 16, generator=gen)
    a = paged_decode_attention(q, k_cache, v_cache, torch.tensor([[3, 5, 6, 7]]), lens, 0.25)
    b = paged_decode_attention(q, k_cache, v_cache, torch.tensor([[3, 5, 0, 1]]), lens, 0.25)
    assert torch.equal(a, b)


def test_a_head_dim_that_is_not_a_power_of_two_is_refused():
    q = torch.zeros(1, 2, 24)
    cache = torch.zeros(2, 16, 1, 24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1.0)
