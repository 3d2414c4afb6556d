"""The compiled paged decode-attention kernel equals the torch path (SDPA over gathered KV).

Random caches in the engine's block-major layout (strided per-layer views), shuffled
block tables, ragged contexts, GQA groups of 1-4, sliding windows, float32 and bfloat16.
The kernel is built by `make setup` (workers/engine/kernels); on a machine that cannot
build it the engine keeps the torch path, and these tests are skipped with that reason.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine import kernels
from workers.engine.attention import AttentionMetadata, _sdpa_decode

MODULE = kernels.load()
pytestmark = pytest.mark.skipif(MODULE is None, reason="the CPU kernel could not be built here (no compiler?)")


def _case(seed: int, batch: int, kv_heads: int, group: int, head_dim: int, block_size: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * block_size, (batch,), generator=gen)
    blocks_needed = (-(-lens // block_size)).tolist()
    num_blocks = sum(blocks_needed) + 3
    layers = 2
    # [blocks, layers, k/v, block_size, kv_heads, head_dim], as the model runner allocates it
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = cache[:, 1].unbind(1)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed)
    tables, used = [], 0
    for need in blocks_needed:
        tables.append(order[used:used + need] + [0] * (width - need))
        used += need
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), slot_blocks=None, slot_offsets=None,
                             num_decode_tokens=batch, decode_block_tables=torch.tensor(tables, dtype=torch.long),
                             decode_context_lens=lens, prefills=[], block_size=block_size)
    return q, k_cache, v_cache, meta


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 6), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       head_dim=st.sampled_from([8, 32, 64]), block_size=st.sampled_from([4, 16]),
       window=st.sampled_from([None, 1, 5, 40]))
def test_the_kernel_equals_sdpa_over_gathered_kv(seed, batch, kv_heads, group, head_dim, block_size, window):
    q, k_cache, v_cache, meta = _case(seed, batch, kv_heads, group, head_dim, block_size, torch.float32)
    scale = head_dim ** -0.5
    expected = _sdpa_decode(q, k_cache, v_cache, meta, window, scale)
    got = MODULE.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                        scale, window or 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_accumulates_in_float32():
    q, k_cache, v_cache, meta = _case(7, 4, 2, 3, 64, 16, torch.bfloat16)
    scale = 64 ** -0.5
    reference = _sdpa_decode(q.float(), k_cache.float(), v_cache.float(), meta, None, scale)
    got = MODULE.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                        scale, 0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    q, k_cache, v_cache, meta = _case(1, 2, 2, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="int64"):
        MODULE.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables.int(), meta.decode_context_lens,
                                      1.0, 0)
    with pytest.raises(RuntimeError, match="head shapes"):
        MODULE.paged_decode_attention(q[:, :, :16], k_cache, v_cache, meta.decode_block_tables,
                                      meta.decode_context_lens, 1.0, 0)
    too_long = meta.decode_context_lens.clone()
    too_long[0] = meta.decode_block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        MODULE.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, too_long, 1.0, 0)
    outside = meta.decode_block_tables.clone()
    outside[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        MODULE.paged_decode_attention(q, k_cache, v_cache, outside, meta.decode_context_lens, 1.0, 0)


def test_a_built_library_loads_without_a_compiler_whatever_a_killed_build_left(tmp_path):
    """A killed builder leaves torch's plain-file lock, half-written objects and a compiler that
    goes on rewriting them; when every start ran ninja, later starts waited on the lock or
    compiled again. A finished build is one file: a fresh process loads it with no compiler
    and no ninja on its PATH, next to a build directory in that state."""
    import os
    import subprocess
    import sys

    leftover = kernels.build_root() / f"{kernels.build_name()}.build-killed"
    leftover.mkdir(parents=True, exist_ok=True)
    (leftover / "lock").touch()
    (leftover / "paged_decode_attention.o").write_bytes(b"half written")
    no_tools = tmp_path / "bin"
    no_tools.mkdir()
    probe = "from workers.engine import kernels; assert kernels.load() is not None; print('loaded')"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PATH": str(no_tools)})
    finally:
        import shutil
        shutil.rmtree(leftover, ignore_errors=True)
    assert done.stdout.strip() == "loaded", done.stderr[-2000:]
