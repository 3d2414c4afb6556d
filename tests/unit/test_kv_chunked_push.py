"""KvStageManager's chunked push: which token ranges go out, and when (DynaServe §4.3).

The engine loop and the transport are stand-ins that record calls: this tests the
chunk planning alone. Real transports are covered by tests/integration/test_kv_transport.py
and the whole path by tests/e2e/test_stages.py.
"""

from __future__ import annotations

import asyncio

import torch

from splitserve.core import KvSink, StageKey
from workers.kv_stages import KvStageManager
from workers.kv_transfer.base import BlockTransfer, KvMemory
from workers.kv_transfer.tracker import TransferTracker

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class RecordingLoop:
    """The EngineLoop methods KvStageManager uses; the test drives progress reports by hand."""

    def __init__(self, block_table: list[int]):
        self.block_table = block_table
        self.watchers: dict = {}
        self.kv_blocks_calls = 0

    def watch(self, request_id, callback):
        self.watchers[request_id] = callback

    def unwatch(self, request_id):
        self.watchers.pop(request_id, None)

    async def call(self, fn):
        class Engine:
            def kv_blocks(inner, request_id):
                self.kv_blocks_calls += 1
                return self.block_table, 0

            def release(inner, request_id):
                pass

        return fn(Engine())


class RecordingTransport:
    name = "recording"

    def __init__(self) -> None:
        self.pushed: list[tuple[int, int, tuple[int, ...]]] = []

    async def push(self, transfer: BlockTransfer, checksum, timeout_s):
        self.pushed.append((transfer.token_start, transfer.token_end, transfer.src_blocks))

    def incoming_done(self, transfer_id):
        pass


def manager(loop: RecordingLoop, fault: str = "") -> tuple[KvStageManager, RecordingTransport]:
    memory = KvMemory(torch.zeros(NUM_BLOCKS, 1, 2, BLOCK_SIZE, 1, 2))
    kv = KvStageManager("w0", loop, memory, TransferTracker(), transfer_timeout_s=5, reservation_ttl_s=5,
                        fault_injection=fault)
    kv.transport = transport = RecordingTransport()
    return kv, transport


def run_stage(steps: list[int], stop_at: int, chunk_tokens: int, fault: str = "") -> tuple[list, RecordingLoop]:
    table = list(range(10, 10 + -(-stop_at // BLOCK_SIZE)))
    loop = RecordingLoop(table)

    async def main():
        kv, transport = manager(loop, fault)
        key = StageKey("r1", 0)
        kv.start_push(key, KvSink("w1", "t1", tuple(range(40, 40 + len(table))), chunk_tokens), stop_at)
        for computed in steps:
            loop.watchers[key](computed, table)
            await asyncio.sleep(0)  # let the pusher task run, as the event loop would between steps
        # True even under the truncate fault: the sender cannot tell; the receiver times out.
        assert await kv.finish_push(key, completed=True) is True
        return transport.pushed

    return asyncio.run(main()), loop


def test_whole_chunks_while_computing_and_the_tail_from_the_last_step_report():
    pushed, loop = run_stage(steps=[8, 16, 24, 30], stop_at=30, chunk_tokens=8)
    assert [(a, b) for a, b, _ in pushed] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert pushed[-1][2] == (16, 17)  # blocks of tokens 24..29
    # The tail came from the step report: no extra round trip to the engine thread.
    assert loop.kv_blocks_calls == 0


def test_a_step_of_several_chunks_queues_them_all():
    pushed, _ = run_stage(steps=[20, 40], stop_at=40, chunk_tokens=8)
    assert [(a, b) for a, b, _ in pushed] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]


def test_without_a_final_report_the_tail_goes_when_the_stage_ends():
    pushed, loop = run_stage(steps=[8], stop_at=30, chunk_tokens=8)
    assert [(a, b) for a, b, _ in pushed] == [(0, 8), (8, 30)]
    assert loop.kv_blocks_calls == 1


def test_one_transfer_after_the_last_step():
    pushed, _ = run_stage(steps=[8, 16, 30], stop_at=30, chunk_tokens=1 << 30)
    assert [(a, b) for a, b, _ in pushed] == [(0, 30)]


def test_truncate_fault_never_sends_the_tail():
    pushed, _ = run_stage(steps=[8, 16, 30], stop_at=30, chunk_tokens=8, fault="truncate")
    assert [(a, b) for a, b, _ in pushed] == [(0, 8), (8, 16), (16, 24)]
