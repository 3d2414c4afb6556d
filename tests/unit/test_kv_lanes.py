"""Splitting a transfer across NIXL lanes, and the metadata a multi-lane worker publishes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.kv_transfer.base import BlockTransfer, KvTransferError, split_transfer
from workers.kv_transfer.nixl_wire import (
    NixlMemoryHeader,
    decode_write_notification,
    encode_write_notification,
    lane_agent_name,
    pack_published_metadata,
    unpack_published_metadata,
)

BLOCK_SIZE = 16


@st.composite
def transfers(draw) -> BlockTransfer:
    num_blocks = draw(st.integers(1, 40))
    start = draw(st.integers(0, 200))
    aligned = start - start % BLOCK_SIZE
    # The blocks cover [aligned, aligned + n * BLOCK_SIZE); the range ends in the last one.
    lowest = max(start + 1, aligned + (num_blocks - 1) * BLOCK_SIZE + 1)
    end = draw(st.integers(lowest, aligned + num_blocks * BLOCK_SIZE))
    src = tuple(draw(st.permutations(range(100)))[:num_blocks])
    dst = tuple(draw(st.permutations(range(100)))[:num_blocks])
    return BlockTransfer("t", "a", "b", src, dst, start, end, request_id="r")


@settings(max_examples=300, deadline=None)
@given(transfers(), st.integers(1, 8))
def test_parts_cover_the_blocks_and_tokens_in_order(transfer, lanes):
    parts = split_transfer(transfer, lanes, BLOCK_SIZE)
    assert len(parts) == min(lanes, len(transfer.dst_blocks))
    assert sum((p.src_blocks for p in parts), ()) == transfer.src_blocks
    assert sum((p.dst_blocks for p in parts), ()) == transfer.dst_blocks
    assert parts[0].token_start == transfer.token_start and parts[-1].token_end == transfer.token_end
    for before, after in zip(parts, parts[1:]):
        assert before.token_end == after.token_start  # contiguous, no token twice
    for part in parts:
        assert part.transfer_id == transfer.transfer_id and part.request_id == transfer.request_id
        assert part.dst_blocks and part.token_start < part.token_end
        # Every block of a part holds some of its tokens.
        aligned = part.token_start - part.token_start % BLOCK_SIZE
        assert -(-(part.token_end - aligned) // BLOCK_SIZE) == len(part.dst_blocks)


def test_one_lane_is_the_transfer_itself():
    transfer = BlockTransfer("t", "a", "b", (1, 2), (3, 4), 0, 32)
    assert split_transfer(transfer, 1, BLOCK_SIZE) == [transfer]


def _header(lanes: int) -> NixlMemoryHeader:
    return NixlMemoryHeader(agent="w-1", base_addr=1 << 40, block_bytes=4096, num_blocks=64, mem_type="DRAM",
                            dev_id=0, incarnation="abc", lanes=lanes)


@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_published_metadata_round_trips_every_lane(lanes):
    blobs = [bytes([k]) * (100 + k) for k in range(lanes)]
    header, back = unpack_published_metadata(pack_published_metadata(_header(lanes), blobs))
    assert header == _header(lanes) and back == blobs


def test_malformed_or_truncated_metadata_is_a_transfer_error():
    value = pack_published_metadata(_header(2), [b"x" * 50, b"y" * 50])
    for bad in (b"nonsense", value[:-10], b"SSNX2" + value[5:12]):
        with pytest.raises(KvTransferError):
            unpack_published_metadata(bad)
    with pytest.raises(ValueError, match="lanes"):
        pack_published_metadata(_header(2), [b"only one"])


def test_lane_agent_names():
    assert [lane_agent_name("w-1", k) for k in range(3)] == ["w-1", "w-1#1", "w-1#2"]


def test_write_notification_round_trip():
    part = BlockTransfer("t", "a", "b", (1, 2), (3, 4), 5, 30, request_id="r")
    back, checksum = decode_write_notification(encode_write_notification(part, 2**64 - 1), "b")
    assert back == part and checksum == 2**64 - 1
