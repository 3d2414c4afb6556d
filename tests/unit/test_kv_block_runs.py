"""block_pair_runs: coalesced (source, destination) block runs cover exactly the same bytes in order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.kv_transfer.base import block_pair_runs, block_runs

BLOCK_BYTES = 4096


def byte_ranges(blocks: list[int]) -> list[tuple[int, int]]:
    return [(b * BLOCK_BYTES, (b + 1) * BLOCK_BYTES) for b in blocks]


def expand(runs: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    return ([s + i for s, _, n in runs for i in range(n)], [d + i for _, d, n in runs for i in range(n)])


def test_examples():
    assert block_pair_runs([], []) == []
    assert block_pair_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    # Contiguous on one side only: no merge.
    assert block_pair_runs([4, 5, 6], [10, 12, 13]) == [(4, 10, 1), (5, 12, 2)]
    # Descending runs are separate descriptors (order matters for the pairing).
    assert block_pair_runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        block_pair_runs([1, 2], [1])


pairs = st.integers(0, 60).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 40), min_size=n, max_size=n),
    st.lists(st.integers(0, 40), min_size=n, max_size=n)))


@given(pairs)
def test_runs_cover_exactly_the_same_bytes_in_order(src_dst):
    src, dst = src_dst
    runs = block_pair_runs(src, dst)
    # Each run is one contiguous byte range on each side, of the same length.
    src_bytes = [(s * BLOCK_BYTES, (s + n) * BLOCK_BYTES) for s, _, n in runs]
    dst_bytes = [(d * BLOCK_BYTES, (d + n) * BLOCK_BYTES) for _, d, n in runs]
    assert all(n >= 1 for _, _, n in runs)
    # Split back into blocks, the runs are the original pairs, in order.
    assert expand(runs) == (list(src), list(dst))
    assert sum(b - a for a, b in src_bytes) == sum(b - a for a, b in byte_ranges(list(src)))
    assert sum(b - a for a, b in dst_bytes) == sum(b - a for a, b in byte_ranges(list(dst)))
    # Maximal: no two neighbouring runs could have been one.
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:]):
        assert not (s2 == s1 + n1 and d2 == d1 + n1)


@given(st.lists(st.integers(0, 40), max_size=60))
def test_a_transfer_onto_the_same_blocks_has_the_single_sided_runs(blocks):
    runs = block_pair_runs(blocks, blocks)
    assert [(s, s + n) for s, _, n in runs] == block_runs(blocks)
