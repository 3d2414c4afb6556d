"""A remote incremental prefill on the serving core (AMPD §3): the decode worker lends its
pinned session history to a lazy pull (`Scheduler.lease_session_kv`), and continues the round
from that history plus only the new KV pushed back (`KvInBlocks.start`). Pure: the core
scheduler over a real BlockManager, and the worker's KvStageManager over it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from splitserve.core import KvInBlocks, KvSink, SamplingParams, StageKey, StageSpec
from splitserve.core.sequence import SessionHold
from tests.unit.test_kv_reservations import _Loop
from tests.unit.test_scheduler import Sim
from tests.unit.test_session_pins import run_round
from workers.kv_stages import KvStageManager, _OutgoingPush
from workers.kv_transfer.base import BlockTransfer
from workers.kv_transfer.tracker import TransferTracker
from splitserve.core.stage import KvPushPlan

BS = 4


def _pinned_round(sim: Sim, prompt_len: int = 18) -> tuple[list[int], list[int]]:
    """Round 1 of session "s" run here; (its history tokens, its pinned blocks)."""
    first = run_round(sim, "r0", list(range(100, 100 + prompt_len)), "s")
    return list(first.token_ids), sim.sched.session_pins.blocks_of("s")


def _refs_consistent(sim: Sim, lent: list[int] = ()) -> None:
    held = [b for s in sim.sched.sequences.values() for b in s.block_table]
    pinned = sim.sched.session_pins.block_ids()
    assert sum(sim.bm.ref_counts(list(range(sim.bm.num_blocks)))) == len(held) + len(pinned) + len(lent)


def test_a_lease_keeps_the_history_blocks_through_eviction_of_the_pin():
    sim = Sim(32, BS, 64, 4)
    _, pinned = _pinned_round(sim)
    lent = sim.sched.lease_session_kv("s", 13)
    assert lent == pinned[:3]  # whole blocks of the first 13 tokens
    sim.sched.release_session("s")  # closed (or evicted) while the reader pulls
    assert sim.bm.ref_counts(lent) == [1, 1, 1] and sim.bm.num_used_blocks == 3
    _refs_consistent(sim, lent)
    sim.sched.release_lease(lent)
    assert sim.bm.num_used_blocks == 0
    assert sim.sched.lease_session_kv("s", 100) == [] and sim.sched.lease_session_kv("never", 100) == []


def test_the_next_round_continues_on_the_pinned_history_plus_only_the_new_kv():
    sim = Sim(32, BS, 64, 4)
    history, pinned = _pinned_round(sim)  # 22 tokens, 20 of them pinned (5 blocks)
    lent = sim.sched.lease_session_kv("s", len(history) - 1)
    start = len(lent) * BS
    assert start == 20
    prompt = history + [7, 8, 9, 10, 11]  # 27 tokens: [20, 27) computed on the prefill worker
    reserved = sim.sched.reserve_kv(len(prompt) - start)
    assert len(reserved) == 2
    for pos in range(start, len(prompt)):  # the prefill worker's push writes the new KV
        sim.kv[reserved[(pos - start) // BS]][pos % BS] = prompt[pos]
    spec = StageSpec(StageKey("r1", 1), tuple(prompt), SamplingParams(max_tokens=3), output_ids=(42,),
                     kv=KvInBlocks(tuple(reserved), len(prompt), start), session=SessionHold("s", 60.0, len(history)))
    seq = sim.sched.add_stage(spec)
    sim.sched.release_lease(lent)  # the worker returns the lease once the stage holds the blocks
    assert seq.block_table == pinned + reserved and seq.num_computed_tokens == len(prompt)
    assert sim.sched.kv_prefix_misses == 0 and sim.sched.session_pins.history_hits == 1
    out = sim.sched.schedule()
    assert [(e.start, e.num_new_tokens) for e in out.entries] == [(len(prompt), 1)]  # only the first output token
    sim.seqs["r1"] = seq
    sim.run()
    _refs_consistent(sim)
    sim.sched.release_session("s")
    assert sim.bm.num_used_blocks == 0


def test_new_kv_whose_history_is_gone_is_dropped_and_the_stage_recomputes():
    sim = Sim(32, BS, 64, 4)
    prompt = list(range(300, 327))
    reserved = sim.sched.reserve_kv(len(prompt) - 20)
    seq = sim.sched.add_stage(StageSpec(StageKey("r1", 1), tuple(prompt), SamplingParams(max_tokens=2),
                                        output_ids=(42,), kv=KvInBlocks(tuple(reserved), len(prompt), 20)))
    assert sim.sched.kv_prefix_misses == 1 and not seq.block_table and seq.num_computed_tokens == 0
    assert sim.bm.num_used_blocks == 0  # the orphan new KV went back
    with pytest.raises(ValueError, match="multiple of the block size 4"):
        sim.sched.add_stage(StageSpec(StageKey("r2", 1), tuple(prompt), SamplingParams(max_tokens=2),
                                      output_ids=(42,), kv=KvInBlocks(tuple(sim.sched.reserve_kv(8)), len(prompt), 6)))
    with pytest.raises(ValueError, match="kv start"):
        KvInBlocks((1,), 4, 5)


def _manager(sim: Sim, ttl_s: float = 60.0) -> KvStageManager:
    return KvStageManager("w", _Loop(sim.sched), memory=SimpleNamespace(block_size=BS), tracker=TransferTracker(),
                          transfer_timeout_s=1.0, reservation_ttl_s=ttl_s)


def test_the_worker_reserves_and_waits_for_the_new_kv_only():
    async def scenario():
        sim = Sim(32, BS, 64, 4)
        kv = _manager(sim)
        blocks = await kv.prepare("r1", "r1:0", 27, start=20)
        assert len(blocks) == 2
        with pytest.raises(ValueError, match="multiple of the block size"):
            await kv.prepare("r2", "r2:0", 27, start=6)
        with pytest.raises(ValueError, match="below num_tokens=27"):
            await kv.prepare("r3", "r3:0", 27, start=28)
        kv.on_chunk(BlockTransfer("r1:0", "p", "w", (), (blocks[0],), 20, 24, request_id="r1"), True)
        kv.on_chunk(BlockTransfer("r1:0", "p", "w", (), (blocks[1],), 24, 27, request_id="r1"), True)
        got = await kv.acquire_prefix("r1:0", 27)
        assert got == KvInBlocks(tuple(blocks), 27, 20)
        sim.sched.release_reserved(list(got.block_ids))

    asyncio.run(scenario())


def test_leases_end_with_the_request_on_cancel_or_after_the_ttl():
    async def scenario():
        sim = Sim(32, BS, 64, 4)
        _pinned_round(sim)
        kv = _manager(sim)
        blocks, tokens = await kv.lease_session("r1", "s", 21)
        assert tokens == 20 and len(blocks) == 5
        sim.sched.release_session("s")
        assert sim.bm.num_used_blocks == 5  # lent: still held
        assert await kv.release_for_request("r1") == 1  # Worker.Cancel
        assert sim.bm.num_used_blocks == 0
        assert await kv.lease_session("r2", "s", 21) == ([], 0)  # nothing pinned any more

        _pinned_round(sim)
        stale = _manager(sim, ttl_s=0.0)
        await stale.lease_session("r3", "s", 8)
        sim.sched.release_session("s")
        assert sim.bm.num_used_blocks == 2
        stale.reap_expired()  # a coordinator that never sent the next stage
        for _ in range(3):
            await asyncio.sleep(0)
        assert sim.bm.num_used_blocks == 0
        assert await stale.release_leases("r3") == 0

    asyncio.run(scenario())


class _RecordingTransport:
    def __init__(self):
        self.transfers: list[BlockTransfer] = []

    async def push(self, transfer: BlockTransfer, checksum, timeout_s: float) -> None:
        self.transfers.append(transfer)


def test_a_push_from_the_history_end_maps_onto_the_receivers_new_blocks():
    async def scenario():
        sim = Sim(32, BS, 64, 4)
        kv = KvStageManager("p", _Loop(sim.sched), memory=SimpleNamespace(block_size=BS, block_bytes=64),
                            tracker=TransferTracker(), transfer_timeout_s=1.0, reservation_ttl_s=60)
        kv.transport = _RecordingTransport()
        sink = KvSink("d", "r1:0", (90, 91), chunk_tokens=4, start=20)
        plan = KvPushPlan(4, 27, pushed_upto=sink.start)
        push = _OutgoingPush(StageKey("r1", 0), sink, plan)
        table = list(range(10, 17))  # the prefill worker's own blocks for [0, 27)
        for start, end in plan.ready(27):
            push.queue.put_nowait((start, end, table))
        push.queue.put_nowait(None)
        await kv._pusher(push)
        assert [(t.token_start, t.token_end, t.src_blocks, t.dst_blocks) for t in kv.transport.transfers] == [
            (20, 24, (15,), (90,)), (24, 27, (16,), (91,))]

    asyncio.run(scenario())


class _RecordingPuller:
    def __init__(self):
        self.pulls: list[BlockTransfer] = []

    async def pull(self, transfer: BlockTransfer, timeout_s: float) -> int:
        self.pulls.append(transfer)
        return 0


def test_a_lazy_pull_takes_only_what_the_local_prefix_cache_lacks():
    async def scenario():
        sim = Sim(32, BS, 64, 4)
        history = list(range(500, 520))  # 20 tokens: 5 blocks on the decode worker
        # This (prefill) worker computed the first 12 of them itself in an earlier round.
        sim.add("earlier", history[:12] + [999], max_tokens=1)
        sim.run()
        kv = KvStageManager("p", _Loop(sim.sched), memory=SimpleNamespace(block_size=BS), tracker=TransferTracker(),
                            transfer_timeout_s=1.0, reservation_ttl_s=60)
        kv.transport = _RecordingPuller()
        prompt = history + [7, 8, 9, 10, 11]
        got = await kv.pull_prefix("r1", "d", [90, 91, 92, 93, 94], 20, "r1:history", token_ids=prompt)
        (pull,) = kv.transport.pulls
        assert (pull.token_start, pull.token_end, pull.src_blocks) == (12, 20, (93, 94))  # the last 2 blocks only
        assert got == KvInBlocks(pull.dst_blocks, 20, 12)
        seq = sim.sched.add_stage(StageSpec(StageKey("r1", 0), tuple(prompt), SamplingParams(max_tokens=2),
                                            end=len(prompt), kv=got))
        held = seq.block_table[:3]
        assert seq.block_table[3:] == list(pull.dst_blocks) and seq.num_computed_tokens == 20
        assert sim.bm.ref_counts(held) == [2, 2, 2]  # the stage's and the pull's hold
        assert await kv.release_leases("r1") == 1
        assert sim.bm.ref_counts(held) == [1, 1, 1]

        # Everything cached here already: nothing is pulled, the stage hits its own cache.
        sim.sched.abort(seq.key)
        again = await kv.pull_prefix("r2", "d", [90, 91, 92], 12, "r2:history", token_ids=history[:12] + [5])
        assert again is None and len(kv.transport.pulls) == 1
        assert await kv.release_leases("r2") == 1
        assert sim.bm.num_used_blocks == 0

    asyncio.run(scenario())
