"""KvStageManager's receiving side: a reservation is released exactly once, however it ends.

The engine loop is a stand-in over a real BlockManager (no model, no transport): a stage
waiting for its KV (`acquire_prefix`) races `Worker.Cancel` (`release_for_request`).
"""

from __future__ import annotations

import asyncio

from workers.engine.block_manager import BlockManager
from workers.kv_stages import KvStageManager
from workers.kv_transfer.tracker import TransferTracker


class _Engine:
    def __init__(self, num_blocks: int = 8, block_size: int = 4):
        self.block_manager = BlockManager(num_blocks, block_size)

    def reserve_kv(self, num_tokens: int) -> list[int]:
        return self.block_manager.reserve(self.block_manager.blocks_for_tokens(num_tokens))

    def release_reserved(self, block_ids: list[int]) -> None:
        self.block_manager.release_reserved(block_ids)


class _Loop:
    """EngineLoop.call: run fn(engine) between steps (here: at the next event-loop turn)."""

    def __init__(self, engine: _Engine):
        self.engine = engine

    async def call(self, fn):
        await asyncio.sleep(0)
        return fn(self.engine)


def test_cancel_while_a_stage_waits_for_its_kv_releases_the_blocks_once():
    async def scenario():
        engine = _Engine()
        kv = KvStageManager("w", _Loop(engine), memory=None, tracker=TransferTracker(), transfer_timeout_s=0.2,
                            reservation_ttl_s=60)
        await kv.prepare("req", "req:0", 8)
        waiting = asyncio.create_task(kv.acquire_prefix("req:0", 8))  # the next stage's Execute
        await asyncio.sleep(0.01)
        assert await kv.release_for_request("req") == 1  # Worker.Cancel meanwhile
        taken = engine.block_manager.reserve(2)  # the freed blocks go to someone else
        assert await waiting is None  # recompute, without releasing the blocks a second time
        bm = engine.block_manager
        assert [bm.blocks[b].ref_count for b in taken] == [1, 1]
        assert all(block.ref_count >= 0 for block in bm.blocks)
        assert bm.num_free_blocks == bm.num_blocks - 2

    asyncio.run(scenario())


def test_a_transfer_that_never_arrives_releases_its_reservation():
    async def scenario():
        engine = _Engine()
        kv = KvStageManager("w", _Loop(engine), memory=None, tracker=TransferTracker(), transfer_timeout_s=0.05,
                            reservation_ttl_s=60)
        await kv.prepare("req", "req:0", 8)
        assert await kv.acquire_prefix("req:0", 8) is None  # timed out: recompute
        assert await kv.release_for_request("req") == 0  # nothing left to cancel
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    asyncio.run(scenario())
