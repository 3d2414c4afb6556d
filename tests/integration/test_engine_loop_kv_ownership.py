"""Reserved KV blocks always have an owner, however the caller that asked for them ends.

A worker's gRPC handlers reserve blocks through the engine thread (`EngineLoop.call`) and
hand received KV to a new stage (`EngineLoop.add`). When the caller's RPC is cancelled in
between (its coordinator died: found by the control-plane fault test, 3 blocks held for
good after a coordinator restart), nothing else knows those blocks: they must be given
back. Real engine (tiny random Llama) on its own thread; the engine thread is held on a
gate so that the cancellation lands while the engine works on the call.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from splitserve.core import KvInBlocks, KvSink, SamplingParams, StageKey, StageSpec
from workers.engine import Engine, EngineConfig
from workers.engine_loop import EngineLoop, StageBusy
from workers.kv_stages import KvStageManager
from workers.kv_transfer.base import KvMemory, KvTransferError
from workers.kv_transfer.tracker import TransferTracker


async def _free_blocks(loop: EngineLoop) -> tuple[int, int]:
    load = await loop.call(lambda engine: engine.load())
    return load.free_blocks, load.total_blocks


async def _until_all_free(loop: EngineLoop, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = await _free_blocks(loop)
        if free == total:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{total - free} KV blocks still held {timeout_s} s later")
        await asyncio.sleep(0.01)  # polling, with a deadline


def _run(tiny_model_dirs, scenario) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dirs["llama"])))

    async def main() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            await scenario(loop)
        finally:
            loop.stop()

    asyncio.run(main())


async def _cancel_while_the_engine_works_on_it(loop: EngineLoop, coroutine) -> None:
    """Start `coroutine` while the engine thread is held (bounded: 10 s), cancel it once its
    engine call is on its way, then let the engine answer a caller that has left."""
    gate = threading.Event()
    loop.call(lambda engine: gate.wait(10))
    task = asyncio.create_task(coroutine)
    await asyncio.sleep(0)  # its call is queued behind the held one
    task.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_reservation_whose_caller_was_cancelled_is_released(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        kv = KvStageManager("w", loop, memory=None, tracker=TransferTracker(), transfer_timeout_s=1.0,
                            reservation_ttl_s=600)  # far beyond the test: only the undo can free them
        await _cancel_while_the_engine_works_on_it(loop, kv.prepare("req", "req:0", 40))
        await _until_all_free(loop)
        assert await kv.release_for_request("req") == 0  # never recorded: nothing to free twice

    _run(tiny_model_dirs, scenario)


def test_received_kv_of_a_stage_that_never_starts_is_released(tiny_model_dirs):
    """Three ways a stage with KV in reserved blocks fails to start: refused by the engine,
    busy past its wait, or its caller cancelled while it waits for an earlier attempt."""
    async def scenario(loop: EngineLoop) -> None:
        key = StageKey("req", 1)

        async def received(num_tokens: int = 8) -> KvInBlocks:
            return KvInBlocks(tuple(await loop.call(lambda engine: engine.reserve_kv(num_tokens))), num_tokens)

        # Refused: a token id beyond the vocabulary.
        with pytest.raises(ValueError):
            await loop.add(StageSpec(key, (10**9,) * 12, SamplingParams(max_tokens=2), kv=await received()))
        await _until_all_free(loop)

        # An earlier attempt holds the key (its stream is open) for the whole wait.
        earlier = await loop.add(StageSpec(key, tuple(range(5, 17)), SamplingParams(max_tokens=500, temperature=0.0)))
        with pytest.raises(StageBusy):
            await loop.add(StageSpec(key, tuple(range(5, 17)), SamplingParams(max_tokens=2), kv=await received()),
                           superseded_wait_s=0.05)
        waiting = asyncio.create_task(loop.add(
            StageSpec(key, tuple(range(5, 17)), SamplingParams(max_tokens=2), kv=await received()),
            superseded_wait_s=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loop.abort(key)
        assert earlier is not None
        await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)


def test_a_stage_whose_caller_left_while_the_engine_took_it_frees_its_blocks(tiny_model_dirs):
    async def scenario(loop: EngineLoop) -> None:
        key = StageKey("req", 1)
        for prompt in (tuple(range(5, 17)), (10**9,) * 12):  # taken (then aborted), and refused
            blocks = await loop.call(lambda engine: engine.reserve_kv(8))
            await _cancel_while_the_engine_works_on_it(loop, loop.add(
                StageSpec(key, prompt, SamplingParams(max_tokens=2), kv=KvInBlocks(tuple(blocks), 8))))
            await _until_all_free(loop)

    _run(tiny_model_dirs, scenario)


class _StalledTransport:
    """A push the receiver never acknowledges (it stopped reading): it fails at its timeout."""

    name = "stalled"

    def __init__(self) -> None:
        self.pushing = asyncio.Event()
        self.pushes_ended = 0

    async def push(self, transfer, checksum, timeout_s):
        self.pushing.set()
        try:
            await asyncio.sleep(timeout_s)
        finally:
            self.pushes_ended += 1
        raise KvTransferError(f"no answer from {transfer.dst_worker} in {timeout_s} s")

    def incoming_done(self, transfer_id):
        pass


def test_a_finished_stage_whose_caller_left_during_its_last_push_frees_its_blocks(tiny_model_dirs):
    """The stage ended and its KV push to the next stage's worker was under way when the RPC was
    cancelled (its coordinator died: found by the restart test of the control-plane faults, 3
    blocks held for good). A finished stage with a sink holds its KV until the push ends: the
    cancelled push must still give the blocks back."""
    async def scenario(loop: EngineLoop) -> None:
        memory = KvMemory(loop.engine.kv_cache)
        kv = KvStageManager("w", loop, memory, TransferTracker(), transfer_timeout_s=1.0, reservation_ttl_s=600)
        kv.transport = transport = _StalledTransport()
        key = StageKey("req", 0)
        prompt = tuple(range(5, 45))
        # One chunk (larger than the stage): the whole KV leaves in one transfer from the last step.
        sink = KvSink("other", "req:1", tuple(range(100, 100 + -(-45 // memory.block_size))), 64)
        events = await loop.add(StageSpec(key, prompt, SamplingParams(max_tokens=5, temperature=0.0), end=45,
                                          sink=sink))
        kv.start_push(key, sink, 45)
        while not (await events.get()).finished:
            pass
        free, total = await _free_blocks(loop)
        assert free < total  # held for the push
        finishing = asyncio.create_task(kv.finish_push(key, completed=True))
        await asyncio.wait_for(transport.pushing.wait(), 10)
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        # The transfer under way still reads the blocks: they stay until it ends, then go back.
        free, total = await _free_blocks(loop)
        assert free < total and transport.pushes_ended == 0
        await _until_all_free(loop)
        assert transport.pushes_ended == 1

    _run(tiny_model_dirs, scenario)
