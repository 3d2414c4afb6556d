"""KvStageManager's receiving side: a reservation is released exactly once, however it ends.

The engine is the serving core's own `Scheduler` over a real BlockManager (no model, no
transport), reached as the engine loop reaches it: a stage waiting for its KV
(`acquire_prefix`) races `Worker.Cancel` (`release_for_request`).
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve.core import (BlockManager, FcfsPolicy, KvCapacityError, KvInBlocks, SamplingParams, Scheduler,
                             SchedulerConfig, StageKey, StageSpec)
from workers.kv_stages import KvStageManager
from workers.kv_transfer.base import BlockTransfer
from workers.kv_transfer.tracker import TransferTracker


def _engine(num_blocks: int = 8, block_size: int = 4) -> Scheduler:
    """The core scheduler: `reserve_kv` / `release_reserved` / `add_stage` as Engine delegates them."""
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024, vocab_size=1024),
                     BlockManager(num_blocks, block_size), FcfsPolicy(), clock=lambda: 0.0)


class _Loop:
    """EngineLoop.call: run fn(engine) between steps (here: at the next event-loop turn)."""

    def __init__(self, engine: Scheduler):
        self.engine = engine

    async def call(self, fn, undo=None):  # a cancelled caller's fn never runs here: nothing to undo
        await asyncio.sleep(0)
        return fn(self.engine)

    def reserve_kv(self, num_tokens, wait, undo=None):
        """EngineLoop.reserve_kv without its line (tests/integration/test_kv_reserve_wait.py has it)."""
        assert not wait, "this stand-in does not wait for room"
        return self.call(lambda engine: engine.reserve_kv(num_tokens))


def _manager(engine: Scheduler, timeout_s: float) -> KvStageManager:
    return KvStageManager("w", _Loop(engine), memory=None, tracker=TransferTracker(), transfer_timeout_s=timeout_s,
                          reservation_ttl_s=60)


def test_cancel_while_a_stage_waits_for_its_kv_releases_the_blocks_once():
    async def scenario():
        engine = _engine()
        kv = _manager(engine, 0.2)
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
        engine = _engine()
        kv = _manager(engine, 0.05)
        await kv.prepare("req", "req:0", 8)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 2
        assert await kv.acquire_prefix("req:0", 8) is None  # timed out: recompute
        assert await kv.release_for_request("req") == 0  # nothing left to cancel
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    asyncio.run(scenario())


def test_an_arrived_transfer_becomes_the_next_stages_kv_and_is_freed_with_it():
    async def scenario():
        engine = _engine()
        bm = engine.block_manager
        kv = _manager(engine, 1.0)
        blocks = await kv.prepare("req", "req:0", 8)
        kv.on_chunk(BlockTransfer("req:0", "src", "w", (), tuple(blocks), 0, 8, request_id="req"), True)
        got = await kv.acquire_prefix("req:0", 8)
        assert got == KvInBlocks(tuple(blocks), 8) and bm.num_free_blocks == bm.num_blocks - 2
        key = StageKey("req", 1)
        spec = StageSpec(key, tuple(range(10)), SamplingParams(max_tokens=2), kv=got)
        seq = engine.add_stage(spec)
        assert seq.block_table == blocks and seq.num_computed_tokens == 8  # adopted, nothing recomputed
        out = engine.schedule()
        assert [(e.seq.key, e.start, e.num_new_tokens) for e in out.entries] == [(key, 8, 2)]
        while engine.has_unfinished():
            engine.update_from_output(out, {e.seq.key: 7 for e in out.entries if e.samples}, 0.0)
            out = engine.schedule()
        assert seq.num_output_tokens == 2
        assert bm.num_free_blocks == bm.num_blocks  # the stage's blocks, the adopted ones included
        assert await kv.release_for_request("req") == 0  # claimed: nothing left to release twice

    asyncio.run(scenario())


def test_a_reservation_without_room_raises_and_takes_nothing():
    async def scenario():
        engine = _engine(num_blocks=4)
        kv = _manager(engine, 0.05)
        await kv.prepare("a", "a:0", 12)  # 3 of 4 blocks
        with pytest.raises(KvCapacityError, match="need 2 free KV blocks for 5 tokens, have 1"):
            await kv.prepare("b", "b:0", 5)
        assert engine.block_manager.num_free_blocks == 1
        assert await kv.release_for_request("b") == 0
        assert await kv.release_for_request("a") == 1
        assert engine.block_manager.num_free_blocks == 4

    asyncio.run(scenario())
