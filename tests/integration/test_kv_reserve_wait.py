"""A KV reservation that waits in line for room (Worker.PrepareKv with wait_ms).

The coordinator reserves the next stage's KV before it sends a stage; with no room on the
next worker it waits, first come first served, rather than have that worker recompute the
prompt. Real engine (tiny random Llama) on its own thread, reached through `EngineLoop` and
`KvStageManager` as the worker's PrepareKv handler reaches it; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.core import KvCapacityError, SamplingParams, StageKey, StageSpec
from tests.integration.test_engine_loop_kv_ownership import _free_blocks, _run, _until_all_free
from workers.engine_loop import EngineLoop
from workers.kv_stages import KvStageManager
from workers.kv_transfer.tracker import TransferTracker


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s")
        await asyncio.sleep(0.005)  # polling, with a deadline


async def _full(loop: EngineLoop, kv: KvStageManager) -> tuple[int, int]:
    """Reserve every block as request "a"; the block size and the total."""
    free, total = await _free_blocks(loop)
    block_size = loop.engine.config.block_size
    await kv.prepare("a", "a:0", total * block_size)
    assert (await _free_blocks(loop))[0] == 0
    return block_size, total


def _manager(loop: EngineLoop) -> KvStageManager:
    return KvStageManager("w", loop, memory=None, tracker=TransferTracker(), transfer_timeout_s=1.0,
                          reservation_ttl_s=600)


def test_a_reservation_waits_for_room_and_gets_it_in_line(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        kv = _manager(loop)
        block_size, total = await _full(loop, kv)
        big = asyncio.create_task(kv.prepare("b", "b:0", 2 * block_size, wait_s=10))
        small = asyncio.create_task(kv.prepare("c", "c:0", block_size, wait_s=10))
        await _until(lambda: len(loop._reservation_line) == 2)  # both in line on the engine thread
        # Nobody overtakes the line: a reservation that does not wait fails while others wait.
        with pytest.raises(KvCapacityError, match="waiting for room first"):
            await kv.prepare("d", "d:0", block_size)
        assert not big.done() and not small.done()
        await kv.release_for_request("a")  # room for everyone
        blocks_b, blocks_c = await asyncio.wait_for(asyncio.gather(big, small), 5)
        assert len(blocks_b) == 2 and len(blocks_c) == 1
        assert (await _free_blocks(loop))[0] == total - 3
        assert await kv.release_for_request("b") == 1 and await kv.release_for_request("c") == 1
        await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)


def test_the_head_of_the_line_is_served_first_even_when_a_later_one_would_fit(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        kv = _manager(loop)
        block_size, total = await _full(loop, kv)
        await kv.release_for_request("a")
        await kv.prepare("a", "a:0", (total - 1) * block_size)  # one block free
        head = asyncio.create_task(kv.prepare("b", "b:0", 2 * block_size, wait_s=10))
        await _until(lambda: len(loop._reservation_line) == 1)
        later = asyncio.create_task(kv.prepare("c", "c:0", block_size, wait_s=10))  # would fit now
        await _until(lambda: len(loop._reservation_line) == 2)
        assert not head.done() and not later.done()
        await kv.release_for_request("a")
        await asyncio.wait_for(asyncio.gather(head, later), 5)
        for request_id in ("b", "c"):
            await kv.release_for_request(request_id)
        await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)


def test_a_wait_that_runs_out_raises_and_leaves_nothing_reserved(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        kv = _manager(loop)
        block_size, total = await _full(loop, kv)
        started = time.monotonic()
        with pytest.raises(KvCapacityError, match=r"no room for 16 tokens of KV within 0.1 s"):
            await kv.prepare("b", "b:0", block_size, wait_s=0.1)
        assert time.monotonic() - started >= 0.1
        # Blocks freed after the wait ran out are not handed to the caller that left.
        await kv.release_for_request("a")
        await _until_all_free(loop)
        assert not loop._reservation_line or all(fut.done() for _, fut, _ in loop._reservation_line)
        assert await kv.release_for_request("b") == 0  # never recorded

    _run(tiny_model_dirs, scenario)


def test_a_waiting_reservation_whose_caller_was_cancelled_frees_nothing_twice(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        kv = _manager(loop)
        block_size, total = await _full(loop, kv)
        waiting = asyncio.create_task(kv.prepare("b", "b:0", block_size, wait_s=10))  # its PrepareKv call ends
        await _until(lambda: len(loop._reservation_line) == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        after = asyncio.create_task(kv.prepare("c", "c:0", block_size, wait_s=10))
        await kv.release_for_request("a")
        assert len(await asyncio.wait_for(after, 5)) == 1  # the cancelled one did not hold the line
        assert (await _free_blocks(loop))[0] == total - 1
        await kv.release_for_request("c")
        await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)


def test_a_reservation_larger_than_the_whole_cache_fails_at_once_and_blocks_no_line(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        kv = _manager(loop)
        free, total = await _free_blocks(loop)
        block_size = loop.engine.config.block_size
        with pytest.raises(KvCapacityError, match=f"need {total + 1} free KV blocks"):
            await asyncio.wait_for(kv.prepare("b", "b:0", total * block_size + 1, wait_s=60), 5)
        assert len(await kv.prepare("c", "c:0", block_size)) == 1  # nobody left in line ahead of it
        await kv.release_for_request("c")
        await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)


def test_stages_already_in_the_engine_get_freed_blocks_before_the_line(tiny_model_dirs):
    """A stage the engine could not admit for want of blocks came first: blocks that free go
    to it, not to a reservation waiting for the whole cache (which would starve it)."""
    async def scenario(loop: EngineLoop) -> None:
        kv = _manager(loop)
        block_size, total = await _full(loop, kv)
        events = await loop.add(StageSpec(StageKey("here", 0), tuple(range(5, 5 + 3 * block_size)),
                                          SamplingParams(max_tokens=4, temperature=0.0)))
        await _until(lambda: loop.engine.kv_short)  # refused admission: no free block
        whole = asyncio.create_task(kv.prepare("b", "b:0", total * block_size, wait_s=30))
        await _until(lambda: len(loop._reservation_line) == 1)
        await kv.release_for_request("a")
        tokens = []
        while True:  # the stage runs to its end while the whole-cache reservation waits
            event = await asyncio.wait_for(events.get(), 10)
            tokens += event.token_ids
            if event.finished:
                break
        assert len(tokens) == 4
        assert len(await asyncio.wait_for(whole, 10)) == total  # then it gets every block
        await kv.release_for_request("b")
        await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)
