"""kv_fault_injection=corrupt over NIXL: every block of a WRITE is read from another block."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.kv_transfer.nixl_transport import misdirected_blocks


@given(st.integers(1, 4096).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), min_size=1, max_size=min(n, 64), unique=True))))
def test_every_destination_gets_another_blocks_bytes(pool_and_blocks):
    num_blocks, blocks = pool_and_blocks
    if num_blocks == 1:
        return  # one block in the pool: nothing else to read from (no real cache is that small)
    shifted = misdirected_blocks(tuple(blocks), num_blocks)
    assert len(shifted) == len(blocks)
    assert all(0 <= b < num_blocks for b in shifted)
    assert all(src != dst for src, dst in zip(shifted, blocks))
