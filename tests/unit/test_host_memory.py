"""KV cache memory on huge pages, and the transfer digest over block runs."""

from __future__ import annotations

import mmap

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.host_memory import HUGE_PAGE_BYTES, zeros_on_huge_pages
from workers.kv_transfer.base import EMPTY_DIGEST, KvMemory, kv_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_huge_page_tensor_is_an_aligned_zeroed_contiguous_tensor(dtype):
    shape = (256, 2, 2, 16, 4, 64)  # >= 4 MiB in every dtype: big enough for huge pages
    tensor = zeros_on_huge_pages(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert torch.count_nonzero(tensor) == 0
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    tensor[-1].fill_(3)  # writable to the very last byte
    assert tensor.view(-1)[-1] == 3


def test_huge_page_tensor_outlives_its_builder():
    def build():
        return zeros_on_huge_pages((HUGE_PAGE_BYTES * 2,), torch.uint8)

    tensor = build()
    tensor.fill_(7)  # the mapping must still be alive: this would crash otherwise
    assert int(tensor.sum()) == 7 * HUGE_PAGE_BYTES * 2


def test_small_tensors_are_plain_zeros():
    tensor = zeros_on_huge_pages((3, 5), torch.float32)
    assert torch.equal(tensor, torch.zeros(3, 5))


def test_digest_is_xxh3_of_the_concatenation():
    assert kv_digest([b"ab", b"", b"cd"]) == xxhash.xxh3_64_intdigest(b"abcd")
    assert EMPTY_DIGEST == xxhash.xxh3_64_intdigest(b"")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=16))
def test_memory_checksum_equals_digest_of_read_bytes(block_ids):
    generator = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (16, 2, 2, 4, 1, 8), dtype=torch.uint8, generator=generator)
    memory = KvMemory(cache)
    assert memory.checksum(block_ids) == kv_digest([memory.read(block_ids)])


def test_checksum_changes_with_one_byte():
    cache = torch.zeros(8, 1, 2, 4, 1, 8, dtype=torch.uint8)
    memory = KvMemory(cache)
    before = memory.checksum([1, 2, 5])
    cache[5, 0, 1, 3, 0, 7] = 1
    assert memory.checksum([1, 2, 5]) != before
