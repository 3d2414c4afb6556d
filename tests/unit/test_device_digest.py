"""The KV digest computed on the cache's device (CUDA caches are never copied to the host for
it): its pure-tensor code, run here on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.kv_transfer.base import KvMemory, device_digest


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_same_bytes_same_digest_whatever_the_chunking():
    data = _bytes(4 * 1000 + 8)
    whole = device_digest(data)
    assert device_digest(data.clone()) == whole
    assert all(device_digest(data, chunk_words=c) == whole for c in (1, 7, 64, 1001, 10_000))
    assert device_digest(data.view(4, -1)) == whole  # only the bytes count, not the shape
    assert 0 <= whole < 2**64


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 600), st.data())
def test_any_changed_byte_changes_the_digest(words, data):
    original = _bytes(4 * words, seed=words)
    position = data.draw(st.integers(0, 4 * words - 1))
    delta = data.draw(st.integers(1, 255))
    corrupted = original.clone()
    corrupted[position] = (int(corrupted[position]) + delta) % 256
    assert device_digest(corrupted) != device_digest(original)


def test_truncation_reordering_and_zero_bytes_are_told_apart():
    data = _bytes(4 * 256, seed=3)
    assert device_digest(data[:-4]) != device_digest(data)
    swapped = torch.cat([data[512:], data[:512]])  # two blocks in the other order
    assert device_digest(swapped) != device_digest(data)
    zeros = torch.zeros(4 * 256, dtype=torch.uint8)
    assert device_digest(zeros) != device_digest(zeros[:-4]) != device_digest(torch.zeros(0, dtype=torch.uint8))


def test_a_partial_word_is_refused():
    with pytest.raises(ValueError, match="4-byte words"):
        device_digest(torch.zeros(6, dtype=torch.uint8))


def test_kv_memory_digests_on_the_device_path_detect_corruption_of_a_block_and_of_a_layer():
    cache = torch.randn(8, 3, 2, 4, 2, 8, generator=torch.Generator().manual_seed(1))
    on_device = KvMemory(cache, digest_on_device=True)  # the CUDA path, run on the CPU
    in_place = KvMemory(cache)
    assert not in_place.digest_on_device and on_device.digest_on_device
    blocks = [5, 1, 2]
    full, layer1 = on_device.checksum(blocks), on_device.checksum(blocks, layer=1)
    assert full != in_place.checksum(blocks)  # another function: both ends use the same kind of cache
    assert on_device.checksum(list(blocks)) == full and on_device.checksum([1, 5, 2]) != full
    cache[1, 1, 0, 2, 1, 3] += 1.0  # block 1, layer 1
    assert on_device.checksum(blocks) != full
    assert on_device.checksum(blocks, layer=1) != layer1
    assert on_device.checksum(blocks, layer=0) == KvMemory(cache.clone(), digest_on_device=True).checksum(
        blocks, layer=0)


# ---- the KV block size that lets flash-attn's paged kernels run (the CUDA path) -------------


def test_block_size_auto_is_256_only_where_flash_attn_runs():
    from workers.engine.config import resolve_block_size

    def auto(device="cuda", backend="auto", real=True, flash=True, cuda=True):
        return resolve_block_size(0, device, backend, real_engine=real, have_flash=flash, cuda_available=cuda)

    assert auto() == 256 and auto(device="cuda:1") == 256 and auto(backend="flash") == 256
    assert auto(device="auto") == 256 and auto(device="auto", cuda=False) == 16
    assert auto(flash=False) == 16  # SDPA over gathered KV: the small block wastes less memory
    assert auto(device="cpu") == 16 and auto(backend="sdpa") == 16 and auto(real=False) == 16
    assert resolve_block_size(32, "cuda", "auto", real_engine=True, have_flash=True, cuda_available=True) == 32
    with pytest.raises(ValueError, match="block_size"):
        resolve_block_size(-1, "cpu", "auto", real_engine=True)


def test_the_cpu_worker_keeps_16_token_blocks_without_looking_for_cuda():
    from splitserve.config import WorkerConfig
    from workers.server import engine_config_from

    config = WorkerConfig(model="m", device="cpu")
    assert config.block_size == 0 and engine_config_from(config).block_size == 16
