"""Per-layer push of a stage's last step (issue 12): slicing, the sender's plan, the receiver's assembly.

The engine loop and the transport are stand-ins (as in test_kv_chunked_push.py); real NIXL
transfers with the per-layer push are covered by tests/e2e/test_stages.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.core import KvSink, StageKey
from workers.kv_stages import KvStageManager
from workers.kv_transfer.base import BlockTransfer, KvMemory, LayerAssembler, kv_digest, layer_desc_index
from workers.kv_transfer.nixl_wire import block_descs, decode_write_notification, encode_write_notification, \
    layer_block_descs
from workers.kv_transfer.tracker import TransferTracker

from tests.unit.test_kv_chunked_push import BLOCK_SIZE, NUM_BLOCKS, RecordingLoop

LAYERS = 3


def cache() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, 2, 4, generator=generator)


# ---- slicing ------------------------------------------------------------------------------------
def test_a_layer_slice_of_a_block_is_one_contiguous_range_at_its_descriptor():
    kv = cache()
    memory = KvMemory(kv)
    assert memory.num_layers == LAYERS and memory.layer_bytes * LAYERS == memory.block_bytes
    rows = layer_block_descs(memory.base_ptr, memory.block_bytes, memory.num_blocks, LAYERS, 0)
    assert len(rows) == NUM_BLOCKS * LAYERS
    for block in (0, 5, NUM_BLOCKS - 1):
        for layer in range(LAYERS):
            addr, size, _ = rows[layer_desc_index(block, layer, LAYERS)]
            assert int(addr) == kv[block, layer].data_ptr() and int(size) == memory.layer_bytes
            assert kv[block, layer].is_contiguous()
    # whole-block rows are unchanged, and a block's layer rows tile it exactly
    whole = block_descs(memory.base_ptr, memory.block_bytes, memory.num_blocks, 0)
    assert int(whole[7][0]) == int(rows[layer_desc_index(7, 0, LAYERS)][0])
    with pytest.raises(ValueError):
        layer_desc_index(0, LAYERS, LAYERS)
    with pytest.raises(ValueError):
        layer_block_descs(0, 10, 4, 3, 0)


def test_layer_checksum_covers_exactly_that_layer_of_each_block():
    kv = cache()
    memory = KvMemory(kv)
    blocks = [9, 3, 4]
    expected = kv_digest(kv[b, 1].numpy().tobytes() for b in blocks)
    assert memory.checksum(blocks, 1) == expected
    before = memory.checksum(blocks, 2)
    kv[3, 1, 0, 0, 0, 0] += 1.0  # another layer's slice changes: layer 2's digest does not
    assert memory.checksum(blocks, 2) == before and memory.checksum(blocks, 1) != expected
    with pytest.raises(ValueError):
        memory.checksum(blocks, LAYERS)


def test_notification_carries_the_layer():
    part = BlockTransfer("t1", "a", "b", (1, 2), (5, 6), 8, 16, "r1", layer=2)
    decoded, checksum = decode_write_notification(encode_write_notification(part, 42), "b")
    assert decoded == part and checksum == 42
    whole = BlockTransfer("t1", "a", "b", (1, 2), (5, 6), 8, 16, "r1")
    assert decode_write_notification(encode_write_notification(whole, 7), "b")[0].layer is None


# ---- receiver: a chunk counts once all its layers are in -------------------------------------------
def slice_of(layer: int, start: int = 8, end: int = 16, tid: str = "t1") -> BlockTransfer:
    return BlockTransfer(tid, "a", "b", (1, 2), (5, 6), start, end, "r1", layer=layer)


def test_assembler_reports_the_chunk_when_the_last_layer_lands_in_any_order():
    assembler = LayerAssembler(LAYERS)
    assert assembler.add(slice_of(2), True) is None
    assert assembler.add(slice_of(0), True) is None
    assert assembler.add(slice_of(0), True) is None  # a duplicate counts once
    chunk, ok = assembler.add(slice_of(1), True)
    assert ok and chunk.layer is None and (chunk.token_start, chunk.token_end) == (8, 16)
    assert assembler.pending() == 0


def test_assembler_keeps_chunks_of_one_transfer_apart_and_fails_on_any_bad_slice():
    assembler = LayerAssembler(LAYERS)
    for layer in range(LAYERS - 1):
        assert assembler.add(slice_of(layer, 0, 8), True) is None
        assert assembler.add(slice_of(layer, 8, 16), True) is None
    chunk, ok = assembler.add(slice_of(LAYERS - 1, 0, 8), False)
    assert not ok and chunk.layer is None
    assert assembler.add(slice_of(LAYERS - 1, 8, 16), True) is None  # the transfer failed already
    assembler.forget("t1")
    assert assembler.pending() == 0


# ---- sender: the last step's range goes per layer, the earlier chunks as before ------------------------
class LayerLoop(RecordingLoop):
    def __init__(self, block_table):
        super().__init__(block_table)
        self.layer_watchers: dict = {}

    def watch_layers(self, key, stop_at, callback):
        self.layer_watchers[key] = (stop_at, callback)
        return True

    def unwatch(self, key):
        super().unwatch(key)
        self.layer_watchers.pop(key, None)


class LayerTransport:
    name = "recording"
    supports_layer_push = True

    def __init__(self) -> None:
        self.pushed: list[tuple[int, int, int | None]] = []

    async def push(self, transfer: BlockTransfer, checksum, timeout_s):
        self.pushed.append((transfer.token_start, transfer.token_end, transfer.layer))

    def incoming_done(self, transfer_id):
        pass


def run_layered(steps: list[int], stop_at: int, chunk_tokens: int, fault: str = "", layer_push: bool = True):
    table = list(range(10, 10 + -(-stop_at // BLOCK_SIZE)))
    loop = LayerLoop(table)

    async def main():
        kv = KvStageManager("w0", loop, KvMemory(cache()), TransferTracker(), transfer_timeout_s=5,
                            reservation_ttl_s=5, fault_injection=fault, layer_push=layer_push)
        kv.transport = transport = LayerTransport()
        key = StageKey("r1", 0)
        kv.start_push(key, KvSink("w1", "t1", tuple(range(40, 40 + len(table))), chunk_tokens), stop_at)
        for computed in steps:
            watch = loop.layer_watchers.get(key)
            if computed >= stop_at and watch is not None:  # the engine's last step, layer by layer
                for layer in range(LAYERS):
                    watch[1](layer, table)  # called on the engine thread; hops to this loop
                    await asyncio.sleep(0)
            loop.watchers[key](computed, table)
            await asyncio.sleep(0)
        # True even under the truncate fault: the sender cannot tell; the receiver times out.
        assert await kv.finish_push(key, completed=True) is True
        assert key not in loop.layer_watchers
        return transport.pushed

    return asyncio.run(main())


def test_last_step_goes_layer_by_layer_and_its_report_adds_nothing():
    pushed = run_layered(steps=[8, 16, 24, 30], stop_at=30, chunk_tokens=8)
    assert pushed == [(0, 8, None), (8, 16, None), (16, 24, None), (24, 30, 0), (24, 30, 1), (24, 30, 2)]


def test_last_step_of_several_chunks_goes_per_layer_as_one_range():
    pushed = run_layered(steps=[8, 30], stop_at=30, chunk_tokens=8)
    assert pushed == [(0, 8, None), (8, 30, 0), (8, 30, 1), (8, 30, 2)]


def test_switched_off_pushes_whole_chunks():
    pushed = run_layered(steps=[8, 16, 24, 30], stop_at=30, chunk_tokens=8, layer_push=False)
    assert pushed == [(0, 8, None), (8, 16, None), (16, 24, None), (24, 30, None)]


def test_truncate_fault_drops_the_last_layer_of_the_last_step():
    pushed = run_layered(steps=[8, 16, 24, 30], stop_at=30, chunk_tokens=8, fault="truncate")
    assert pushed == [(0, 8, None), (8, 16, None), (16, 24, None), (24, 30, 0), (24, 30, 1)]
