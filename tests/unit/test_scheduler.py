"""Scheduler: token budget, running-first, chunked prefill, preemption, prefix hits.

The engine loop is simulated without a model: every entry that samples gets a
deterministic fake token appended, and a request finishes after max_tokens outputs.
A fake KV store (block id -> token per slot) is written for every scheduled token, so
each step also checks that a sequence only ever attends to KV of its own tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledEntry, Scheduler, SchedulerOutput
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from workers.policies.base import Batch, BatchEntry, ExecutedBatch
from workers.policies.fcfs import FcfsPolicy


def fake_token(seq: Sequence) -> int:
    """Deterministic 'model output': depends only on the position."""
    return (seq.num_tokens * 7 + 3) % 11


class Sim:
    def __init__(self, num_blocks, block_size, max_tokens_per_step, max_num_seqs, prefix_caching=True,
                 policy=None):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.now = 0.0
        self.policy = policy or FcfsPolicy()
        self.sched = Scheduler(self.bm, self.policy, max_tokens_per_step, max_num_seqs, lambda: self.now)
        self.kv: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.finished: dict[str, Sequence] = {}
        self.steps = 0
        self.history: list[SchedulerOutput] = []

    def add(self, rid, prompt, max_tokens=4, arrival=None) -> Sequence:
        seq = Sequence(
            request_id=rid,
            token_ids=list(prompt),
            prompt_len=len(prompt),
            params=SamplingParams(max_tokens=max_tokens),
            seed=0,
            arrival_time=self.now if arrival is None else arrival,
        )
        self.sched.add(seq)
        return seq

    def add_with_kv(self, rid, prompt, prefix_len, max_tokens=4) -> Sequence:
        """A later stage: KV of [0, prefix_len) arrived from another worker into reserved blocks."""
        seq = Sequence(request_id=rid, token_ids=list(prompt), prompt_len=len(prompt),
                       params=SamplingParams(max_tokens=max_tokens), seed=0, arrival_time=self.now)
        blocks = self.bm.reserve(self.bm.blocks_for_tokens(prefix_len))
        bs = self.bm.block_size
        for pos in range(prefix_len):  # the transfer writes the other worker's KV
            self.kv[blocks[pos // bs]][pos % bs] = seq.token_ids[pos]
        self.bm.adopt(seq, blocks, prefix_len)
        self.sched.add(seq)
        return seq

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_step(out)
        return out

    def check_step(self, out: SchedulerOutput) -> None:
        sched, bm = self.sched, self.bm
        assert out.num_tokens <= sched.budget.max_num_batched_tokens
        assert len(out.entries) <= sched.budget.max_num_seqs
        assert len(sched.running) <= sched.budget.max_num_seqs
        ids = [e.seq.request_id for e in out.entries]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        for e in out.entries:
            assert e.num_new_tokens >= 1
            assert e.seq.status is SequenceStatus.RUNNING and e.seq in sched.running
            assert e.start == e.seq.num_computed_tokens
            assert e.start + e.num_new_tokens <= e.seq.num_tokens
            assert len(e.seq.block_table) >= bm.blocks_for_tokens(e.start + e.num_new_tokens)
        for p in out.preempted:
            assert p.status is SequenceStatus.WAITING and p in sched.waiting
            assert p.block_table == [] and p.num_computed_tokens == 0
            assert p.request_id not in ids
        # ref counts == number of live sequences holding the block; free pools == ref 0
        holders = [0] * bm.num_blocks
        for s in sched.sequences.values():
            for b in s.block_table:
                holders[b] += 1
        assert [b.ref_count for b in bm.blocks] == holders
        assert bm.num_free_blocks == holders.count(0)
        for s in sched.waiting:
            assert s.status is SequenceStatus.WAITING
            # Waiting with blocks only when its KV came from elsewhere: exactly its computed tokens.
            assert len(s.block_table) == bm.blocks_for_tokens(s.num_computed_tokens)
        # fake KV: reads must see own tokens, writes must not touch blocks shared with others
        bs = bm.block_size
        written: set[tuple[int, int]] = set()
        for e in out.entries:
            seq = e.seq
            for pos in range(e.start):
                b = seq.block_table[pos // bs]
                assert self.kv[b][pos % bs] == seq.token_ids[pos], (
                    f"{seq.request_id} would attend to foreign KV at position {pos} (block {b})"
                )
            for pos in range(e.start, e.start + e.num_new_tokens):
                b = seq.block_table[pos // bs]
                assert holders[b] == 1, f"{seq.request_id} writes into block {b} shared with another sequence"
                assert (b, pos % bs) not in written
                written.add((b, pos % bs))
                self.kv[b][pos % bs] = seq.token_ids[pos]

    def finish_step(self, out: SchedulerOutput) -> None:
        self.sched.on_step_done(out, 0.01)
        for e in out.entries:
            if e.samples:
                seq = e.seq
                seq.token_ids.append(fake_token(seq))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq, FinishReason.LENGTH)
                    self.finished[seq.request_id] = seq
        self.steps += 1
        self.now += 1.0

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.history.append(out)
        self.finish_step(out)
        return out

    def run(self, max_steps=10_000) -> None:
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "scheduler did not finish in time"
            self.step()


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(e.seq.request_id, e.start, e.num_new_tokens) for e in out.entries]


# ---- construction -----------------------------------------------------------------


@pytest.mark.parametrize("tokens,seqs", [(0, 1), (1, 0), (-3, 4)])
def test_constructor_rejects_non_positive_budgets(tokens, seqs):
    with pytest.raises(ValueError):
        Scheduler(BlockManager(4, 4), FcfsPolicy(), tokens, seqs, lambda: 0.0)


def test_duplicate_request_id_rejected():
    sim = Sim(8, 4, 16, 4)
    sim.add("a", [1, 2])
    with pytest.raises(ValueError, match="already"):
        sim.add("a", [3])


def test_empty_scheduler_schedules_nothing():
    sim = Sim(8, 4, 16, 4)
    out = sim.schedule()
    assert out.entries == [] and out.preempted == [] and out.num_tokens == 0
    assert not sim.sched.has_unfinished()


# ---- chunked prefill and decode --------------------------------------------------


def test_chunked_prefill_splits_prompt_with_correct_starts_then_decodes_one_token():
    sim = Sim(16, 4, 8, 4)
    a = sim.add("a", list(range(20)), max_tokens=3)
    steps = []
    while sim.sched.has_unfinished():
        out = sim.schedule()
        steps.append((plan(out), [e.samples for e in out.entries]))
        sim.finish_step(out)
    assert steps == [
        ([("a", 0, 8)], [False]),
        ([("a", 8, 8)], [False]),
        ([("a", 16, 4)], [True]),
        ([("a", 20, 1)], [True]),
        ([("a", 21, 1)], [True]),
    ]
    assert a.num_output_tokens == 3 and a.finish_reason is FinishReason.LENGTH
    assert sim.bm.num_free_blocks == 16


def test_decodes_take_one_token_each():
    sim = Sim(32, 4, 64, 8)
    for i in range(4):
        sim.add(f"r{i}", [i] * (3 + i), max_tokens=5)
    first = sim.step()
    assert plan(first) == [("r0", 0, 3), ("r1", 0, 4), ("r2", 0, 5), ("r3", 0, 6)]
    for _ in range(4):
        out = sim.step()
        assert all(e.num_new_tokens == 1 for e in out.entries)
        assert all(e.start == e.seq.num_tokens - 2 for e in out.entries)  # token appended after
        assert len(out.entries) == 4
    assert not sim.sched.has_unfinished()


def test_samples_flag_only_on_chunk_reaching_the_end():
    seq = Sequence("x", [1, 2, 3, 4, 5], 5, SamplingParams(), 0, 0.0)
    assert not ScheduledEntry(seq, 0, 4).samples
    assert ScheduledEntry(seq, 0, 5).samples
    assert ScheduledEntry(seq, 4, 1).samples
    assert SchedulerOutput([ScheduledEntry(seq, 0, 2), ScheduledEntry(seq, 2, 3)]).num_tokens == 5


# ---- budget and ordering ---------------------------------------------------------


def test_budget_and_max_num_seqs_never_exceeded():
    sim = Sim(64, 4, 10, 3)
    for i in range(8):
        sim.add(f"r{i}", [i] * (1 + 5 * i), max_tokens=1 + i % 4)
    while sim.sched.has_unfinished():
        out = sim.step()
        assert out.num_tokens <= 10
        assert len(out.entries) <= 3
        assert len(sim.sched.running) <= 3
        assert out.entries, "no progress"
    assert len(sim.finished) == 8


def test_budget_is_filled_when_work_is_available():
    sim = Sim(64, 4, 10, 8)
    sim.add("a", list(range(7)), max_tokens=2)
    sim.add("b", list(range(100, 130)), max_tokens=2)
    out = sim.step()
    assert plan(out) == [("a", 0, 7), ("b", 0, 3)]
    out = sim.step()
    assert plan(out) == [("a", 7, 1), ("b", 3, 9)]


def test_running_requests_are_scheduled_before_waiting_ones():
    sim = Sim(64, 4, 8, 8)
    sim.add("a", list(range(20)), max_tokens=3)
    sim.add("b", [9] * 4, max_tokens=2)
    assert plan(sim.step()) == [("a", 0, 8)]
    assert plan(sim.step()) == [("a", 8, 8)]
    assert plan(sim.step()) == [("a", 16, 4), ("b", 0, 4)]
    # now both running: a (older) first, and a newly arrived request comes after both
    sim.add("c", [5] * 10, max_tokens=1)
    assert plan(sim.step()) == [("a", 20, 1), ("b", 4, 1), ("c", 0, 6)]


def test_waiting_requests_admitted_in_arrival_order_and_max_num_seqs_blocks_admission():
    sim = Sim(64, 4, 100, 2)
    for rid in "abcd":
        sim.add(rid, [ord(rid)] * 3, max_tokens=2)
    out = sim.step()
    assert [e.seq.request_id for e in out.entries] == ["a", "b"]
    assert [s.request_id for s in sim.sched.waiting] == ["c", "d"]
    out = sim.step()  # a, b decode and finish; c, d must wait for the next step
    assert [e.seq.request_id for e in out.entries] == ["a", "b"]
    out = sim.step()
    assert [e.seq.request_id for e in out.entries] == ["c", "d"]


def test_blocked_waiting_head_is_not_overtaken():
    # head needs more blocks than are free; a small request behind it must not jump ahead
    sim = Sim(4, 4, 64, 8, prefix_caching=False)
    sim.add("big0", [1] * 8, max_tokens=4)  # 2 blocks, a 3rd for the decodes
    sim.step()
    sim.add("big1", [2] * 8, max_tokens=1)  # needs 2 blocks, only 1 free after big0 grows
    sim.add("small", [3], max_tokens=1)  # would fit in the last block
    out = sim.step()
    assert plan(out) == [("big0", 8, 1)]
    assert sim.bm.num_free_blocks == 1
    assert [s.request_id for s in sim.sched.waiting] == ["big1", "small"]
    sim.run()
    assert set(sim.finished) == {"big0", "big1", "small"}


# ---- preemption ------------------------------------------------------------------


def test_preemption_evicts_newest_running_and_requeues_it_at_the_head():
    sim = Sim(4, 2, 64, 8, prefix_caching=False)
    a = sim.add("a", [1, 2, 3], max_tokens=5)  # at most 7 tokens of KV: 4 blocks
    b = sim.add("b", [4, 5, 6], max_tokens=5)
    out = sim.step()
    assert plan(out) == [("a", 0, 3), ("b", 0, 3)]
    assert sim.bm.num_free_blocks == 0
    out = sim.step()  # decodes at position 3: both still fit in their 2 blocks
    assert plan(out) == [("a", 3, 1), ("b", 3, 1)]
    sim.add("c", [7], max_tokens=1)  # waiting behind
    out = sim.schedule()
    # a needs a 3rd block: b (newest) is preempted, recompute-style
    assert plan(out) == [("a", 4, 1)]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert list(sim.sched.waiting) == [b, sim.sched.sequences["c"]]
    assert sim.sched.running == [a]
    assert b.token_ids == [4, 5, 6, fake_token_at(3), fake_token_at(4)]  # outputs are kept
    sim.finish_step(out)
    sim.run()
    assert sim.finished["b"].num_output_tokens == 5
    assert sim.finished["a"].num_output_tokens == 5
    assert sim.finished["b"].output_ids == [fake_token_at(3 + k) for k in range(5)]
    assert sim.bm.num_free_blocks == 4


def fake_token_at(num_tokens_before: int) -> int:
    return (num_tokens_before * 7 + 3) % 11


def test_preempted_sequence_is_recomputed_from_scratch_with_correct_starts():
    sim = Sim(4, 2, 64, 8, prefix_caching=False)
    sim.add("a", [1, 2, 3], max_tokens=6)
    b = sim.add("b", [4, 5, 6], max_tokens=6)
    sim.step()
    sim.step()
    out = sim.step()
    assert out.preempted == [b]
    known = b.num_tokens  # prompt + the outputs sampled before the preemption
    assert known == 5
    # b re-enters once there is room; it recomputes every known token in one chunk
    starts = []
    while "b" not in sim.finished:
        out = sim.step()
        starts += [(e.start, e.num_new_tokens) for e in out.entries if e.seq is b]
    assert starts[0] == (0, known)
    assert starts[1:] == [(known + k, 1) for k in range(len(starts) - 1)]
    assert b.num_output_tokens == 6
    assert b.output_ids == [fake_token_at(3 + k) for k in range(6)]


def test_several_victims_keep_fcfs_order_and_a_stuck_sequence_preempts_itself():
    # 4 sequences x 2 blocks fill the pool; at the next block boundary all need a block.
    # a preempts d (newest); b takes the freed block; c finds no unscheduled victim left
    # and preempts itself. The waiting queue then holds c before d (arrival order),
    # ahead of a request that was already waiting, which is not admitted this step.
    sim = Sim(8, 2, 64, 8, prefix_caching=False)
    a, b, c, d = (sim.add(r, [i] * 3, max_tokens=3) for i, r in enumerate("abcd"))
    sim.step()  # prefill: 2 blocks each, pool full
    sim.step()  # decode at 3: fits
    assert sim.bm.num_free_blocks == 0
    e = sim.add("e", [9], max_tokens=1)
    out = sim.schedule()
    assert plan(out) == [("a", 4, 1), ("b", 4, 1)]
    assert out.preempted == [d, c]
    assert list(sim.sched.waiting) == [c, d, e]
    assert sim.sched.running == [a, b]
    assert c.num_preemptions == d.num_preemptions == 1 and sim.sched.num_preemptions == 2
    sim.finish_step(out)
    sim.run()
    assert set(sim.finished) == set("abcde")
    for s_ in (a, b, c, d):
        assert s_.output_ids == [fake_token_at(3 + k) for k in range(3)]
    assert sim.bm.num_free_blocks == 8


def test_preempted_sequence_hits_its_own_cached_prefix_on_readmission():
    sim = Sim(5, 2, 64, 8, prefix_caching=True)
    a = sim.add("a", [1, 2, 3], max_tokens=5)
    b = sim.add("b", [4, 5, 6, 7, 8], max_tokens=4)
    sim.step()  # a: 2 blocks, b: 3 blocks, pool full
    sim.step()  # a decodes at 3 (fits); b decodes at 5 (fits in 3 blocks)
    b_table = list(b.block_table)
    out = sim.schedule()  # a at 4 needs a 3rd block -> b preempted
    assert out.preempted == [b]
    # b's 3 full blocks were committed and freed tail first; a's growth evicted the tail
    assert sim.bm.cached_prefix_blocks(b) == b_table[:2]
    sim.finish_step(out)
    first = None
    while "b" not in sim.finished:
        expected_hits = len(sim.bm.cached_prefix_blocks(b)) if b in sim.sched.waiting else None
        out = sim.step()
        mine = [e for e in out.entries if e.seq is b]
        if mine and first is None:
            first = mine[0]
            assert first.start == expected_hits * 2
    assert first is not None and first.start > 0  # the re-admission skipped cached KV
    assert b.output_ids == [fake_token_at(5 + k) for k in range(4)]


# ---- prefix caching --------------------------------------------------------------


def test_prefix_cache_hit_reduces_tokens_for_same_prompt():
    prompt = list(range(10))
    sim = Sim(16, 4, 64, 8)
    sim.add("a", prompt, max_tokens=2)
    sim.run()
    sim.add("b", prompt, max_tokens=2)
    out = sim.step()
    assert plan(out) == [("b", 8, 2)]  # 2 full blocks cached, 2 tokens left
    assert sim.bm.prefix_hits_tokens == 8
    sim.run()
    # without prefix caching the whole prompt is scheduled
    cold = Sim(16, 4, 64, 8, prefix_caching=False)
    cold.add("a", prompt, max_tokens=2)
    cold.run()
    cold.add("b", prompt, max_tokens=2)
    assert plan(cold.step()) == [("b", 0, 10)]


def test_prefix_hit_while_first_request_still_running_shares_blocks():
    prompt = list(range(12))  # exactly 3 full blocks: only 2 may be hit
    sim = Sim(16, 4, 64, 8)
    a = sim.add("a", prompt, max_tokens=5)
    sim.step()
    b = sim.add("b", prompt, max_tokens=5)
    out = sim.step()
    assert plan(out) == [("a", 12, 1), ("b", 8, 4)]
    assert b.block_table[:2] == a.block_table[:2]
    assert [sim.bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    sim.run()
    assert sim.bm.num_free_blocks == 16
    assert a.output_ids == b.output_ids


def test_prefix_hits_make_room_in_the_budget_for_others():
    prompt = list(range(16))
    sim = Sim(32, 4, 8, 8)
    sim.add("warm", prompt, max_tokens=1)
    sim.run()
    sim.add("hit", prompt + [99], max_tokens=1)  # 16 cached, 1 to compute
    sim.add("cold", [5] * 20, max_tokens=1)
    out = sim.step()
    assert plan(out) == [("hit", 16, 1), ("cold", 0, 7)]


def test_waiting_hits_evicted_earlier_in_the_same_step_are_not_reused():
    # Regression: prefix hits looked up before the step must not be used after an
    # earlier admission (or growth) in the same step evicted those cached blocks.
    sim = Sim(8, 2, 256, 16)
    sim.add("A", [1, 2, 3, 4, 5], max_tokens=1)
    sim.run()
    sim.add("D", [20, 21, 22, 23, 24], max_tokens=1)
    sim.run()
    # free: 4 plain + 4 cached (LRU: A's [3,4], A's [1,2], D's [22,23], D's [20,21])
    assert sim.bm.num_free_blocks == 8 and len(sim.bm._free_cached) == 4
    b = sim.add("B", [9] * 10, max_tokens=1)  # 5 blocks: drains plain, evicts A's tail
    c = sim.add("C", [1, 2, 3, 4, 6], max_tokens=1)  # looked-up hits: both of A's blocks
    out = sim.schedule()  # check_step verifies KV ownership and that no block is shared
    assert not set(b.block_table) & set(c.block_table)
    sim.finish_step(out)
    sim.run()
    assert c.num_output_tokens == 1


def test_waiting_hits_evicted_by_running_growth_are_not_reused():
    sim = Sim(8, 2, 256, 16)
    sim.add("A", [1, 2, 3, 4, 5], max_tokens=1)
    sim.run()
    sim.add("D", [20, 21, 22, 23, 24], max_tokens=1)
    sim.run()  # cached LRU: A's [3,4], A's [1,2], D's 2 blocks; plain: 4 blocks
    r = sim.add("R", [7] * 8, max_tokens=2)  # 4 blocks: all the plain ones
    sim.step()
    assert sim.bm.num_free_blocks == 4 and len(sim.bm._free_cached) == 4
    c = sim.add("C", [1, 2, 3, 4, 6], max_tokens=1)
    out = sim.schedule()  # R decodes at 8 -> needs a 5th block -> evicts A's tail [3,4]
    assert c in sim.sched.running
    assert not set(r.block_table) & set(c.block_table)
    sim.finish_step(out)
    sim.run()
    assert c.num_output_tokens == 1


# ---- finishing / aborting --------------------------------------------------------


def test_abort_running_sequence_frees_its_blocks():
    sim = Sim(8, 4, 8, 4)
    a = sim.add("a", list(range(20)), max_tokens=4)
    out = sim.schedule()
    assert sim.bm.num_used_blocks == 2
    sim.sched.finish(a, FinishReason.ABORT)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert a not in sim.sched.running and "a" not in sim.sched.sequences
    assert sim.bm.num_free_blocks == 8
    # the step that was in flight completes: the aborted sequence is skipped
    sim.sched.on_step_done(out, 0.0)
    assert a.num_computed_tokens == 0
    assert sim.bm.num_free_blocks == 8
    assert not sim.sched.has_unfinished()


def test_abort_waiting_sequence_removes_it_from_the_queue():
    sim = Sim(8, 4, 4, 1)
    sim.add("a", [1] * 6, max_tokens=2)
    b = sim.add("b", [2] * 6, max_tokens=2)
    sim.step()
    sim.sched.finish(b, FinishReason.ABORT)
    assert list(sim.sched.waiting) == []
    assert "b" not in sim.sched.sequences
    sim.run()
    assert "b" not in sim.finished


def test_keep_kv_finished_sequence_holds_blocks_until_release():
    sim = Sim(8, 4, 64, 4)
    a = sim.add("a", list(range(6)), max_tokens=1)
    a.keep_kv = True
    sim.run()
    assert a.is_finished and "a" in sim.sched.sequences
    assert sim.bm.num_used_blocks == 2
    sim.sched.release("a")
    assert sim.bm.num_free_blocks == 8 and "a" not in sim.sched.sequences
    sim.sched.release("a")  # unknown id: no-op


# ---- policy plumbing -------------------------------------------------------------


class RecordingPolicy(FcfsPolicy):
    def __init__(self):
        self.calls = []
        self.observed: list[ExecutedBatch] = []

    def next_batch(self, running, waiting, budget, now):
        self.calls.append((list(running), list(waiting), budget, now))
        return super().next_batch(running, waiting, budget, now)

    def observe(self, executed):
        self.observed.append(executed)


def test_policy_sees_cached_prefix_clock_and_gets_feedback():
    policy = RecordingPolicy()
    sim = Sim(16, 4, 64, 8, policy=policy)
    sim.add("a", list(range(10)), max_tokens=1)
    sim.now = 5.0
    sim.step()
    running, waiting, budget, now = policy.calls[-1]
    assert now == 5.0 and running == [] and budget.max_num_batched_tokens == 64
    assert waiting[0].num_computed_tokens == 0 and waiting[0].num_tokens == 10
    assert policy.observed[-1] == ExecutedBatch(10, 0, 10, 0.01)
    sim.add("b", list(range(10)) + [1, 2], max_tokens=3)
    sim.step()
    _, waiting, _, _ = policy.calls[-1]
    assert waiting[0].num_computed_tokens == 8  # cached prefix reported to the policy
    sim.step()  # decode of b
    assert policy.observed[-1] == ExecutedBatch(0, 1, 13, 0.01)


class FixedPolicy:
    """Returns whatever batch it is given, to test the scheduler's own clamping."""

    name = "fixed"

    def __init__(self, entries):
        self.entries = entries

    def next_batch(self, running, waiting, budget, now):
        return Batch(list(self.entries))

    def observe(self, executed):
        pass


def test_scheduler_clamps_a_greedy_policy_to_the_budget_and_ignores_junk():
    policy = FixedPolicy([
        BatchEntry("ghost", 5),  # unknown id
        BatchEntry("a", 100),  # more than the budget
        BatchEntry("a", 3),  # duplicate
        BatchEntry("b", 0),  # nothing
        BatchEntry("b", 4),
    ])
    sim = Sim(16, 4, 10, 4, policy=policy)
    sim.add("a", list(range(30)), max_tokens=1)
    sim.add("b", list(range(6)), max_tokens=1)
    out = sim.schedule()
    assert plan(out) == [("a", 0, 10)]
    assert out.num_tokens <= 10


def test_scheduler_enforces_max_num_seqs_even_if_policy_asks_for_more():
    policy = FixedPolicy([BatchEntry(r, 2) for r in "abcd"])
    sim = Sim(16, 4, 100, 2, policy=policy)
    for r in "abcd":
        sim.add(r, [1, 2, 3], max_tokens=1)
    out = sim.schedule()
    assert [e.seq.request_id for e in out.entries] == ["a", "b"]
    assert len(sim.sched.running) == 2


# ---- hypothesis: random request mixes run to completion --------------------------


@st.composite
def workloads(draw, shared_prefixes: bool):
    block_size = draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    n_req = draw(st.integers(1, 8), label="n_req")
    if shared_prefixes:
        bases = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=60), min_size=1, max_size=3))
    reqs = []
    for i in range(n_req):
        if shared_prefixes:
            base = draw(st.sampled_from(bases))
            cut = draw(st.integers(0, len(base)))
            tail = draw(st.lists(st.integers(0, 3), max_size=20))
            prompt = (base[:cut] + tail) or [0]
            prompt = prompt[:200]
        else:
            n = draw(st.integers(1, 200))
            seed = draw(st.integers(0, 10**6))
            prompt = [(seed + j * j) % 97 for j in range(n)]
        max_tokens = draw(st.integers(1, 30))
        arrival_step = draw(st.integers(0, 20))
        reqs.append((f"r{i}", prompt, max_tokens, arrival_step))
    biggest = max(-(-(len(p) + m) // block_size) for _, p, m, _ in reqs)
    num_blocks = biggest + draw(st.integers(0, 2 * biggest), label="extra blocks")
    budget = draw(st.integers(1, 256), label="max_num_batched_tokens")
    max_seqs = draw(st.integers(1, 16), label="max_num_seqs")
    caching = draw(st.booleans()) if not shared_prefixes else True
    return block_size, num_blocks, budget, max_seqs, caching, reqs


def run_workload(block_size, num_blocks, budget, max_seqs, caching, reqs):
    sim = Sim(num_blocks, block_size, budget, max_seqs, prefix_caching=caching)
    pending = sorted(reqs, key=lambda r: r[3])
    total = sum(len(p) + m for _, p, m, _ in reqs)
    bound = 2 * total + 2 * len(reqs) + max(r[3] for r in reqs) + 10
    seqs = {}
    while pending or sim.sched.has_unfinished():
        while pending and pending[0][3] <= sim.steps:
            rid, prompt, m, _ = pending.pop(0)
            seqs[rid] = sim.add(rid, prompt, max_tokens=m)
        assert sim.steps <= bound, f"no completion within {bound} steps"
        had_work = sim.sched.has_unfinished()
        out = sim.step()
        if had_work:
            assert out.entries, "a step with queued work scheduled nothing"
    assert set(sim.finished) == {r[0] for r in reqs}
    for rid, prompt, m, _ in reqs:
        s = seqs[rid]
        assert s.finish_reason is FinishReason.LENGTH
        assert s.num_output_tokens == m
        assert s.token_ids[: len(prompt)] == prompt
        # outputs are the fake model's deterministic tokens, whatever the batching was
        assert s.output_ids == [fake_token_at(len(prompt) + k) for k in range(m)]
    assert sim.bm.num_free_blocks == num_blocks
    assert sim.sched.sequences == {} and not sim.sched.waiting and not sim.sched.running
    return sim


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(shared_prefixes=False))
def test_random_mixes_run_to_completion(w):
    run_workload(*w)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(shared_prefixes=True))
def test_random_mixes_with_shared_prefixes_keep_kv_consistent(w):
    run_workload(*w)


# ---- sequences whose KV arrived from another worker --------------------------------


def test_transferred_kv_waits_for_a_slot_under_max_num_seqs():
    # A decode worker with room for one sequence: a later stage arriving with its KV waits,
    # holding the KV, instead of growing the batch beyond max_num_seqs.
    sim = Sim(16, 4, 64, max_num_seqs=1)
    sim.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    sim.step()
    b = sim.add_with_kv("b", list(range(20, 29)), prefix_len=8, max_tokens=2)
    assert b.status is SequenceStatus.WAITING and len(b.block_table) == 2
    while "a" not in sim.finished:
        out = sim.step()
        assert [e.seq.request_id for e in out.entries] == ["a"]
        assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 8
    out = sim.step()
    assert plan(out) == [("b", 8, 1)]  # nothing recomputed: only the last prompt token
    sim.run()
    assert b.num_preemptions == 0 and sim.bm.num_free_blocks == 16


def test_waiting_kv_holders_do_not_deadlock_when_nothing_runs():
    # Two later stages fill the pool with their KV and each needs one more block to go on.
    # Nothing is running, so nothing will free a block: the newer one's KV is dropped and
    # it recomputes after the older one finishes.
    sim = Sim(4, 4, 64, max_num_seqs=4, prefix_caching=False)
    b = sim.add_with_kv("b", list(range(30, 39)), prefix_len=8, max_tokens=2)
    c = sim.add_with_kv("c", list(range(40, 49)), prefix_len=8, max_tokens=2)
    assert sim.bm.num_free_blocks == 0
    out = sim.step()
    assert plan(out)[0] == ("b", 8, 1)
    assert c.num_preemptions == 1
    assert all(start == 0 for rid, start, _ in plan(out) if rid == "c")  # recomputes from the start
    sim.run()
    assert set(sim.finished) == {"b", "c"} and sim.bm.num_free_blocks == 4


def test_waiting_kv_is_not_dropped_when_that_cannot_make_room():
    # A finished stage keeps its KV for export (4 blocks) and the waiting stages hold 4: even
    # all of their KV would not admit the head (7 blocks), so none of it is thrown away.
    sim = Sim(10, 4, 64, max_num_seqs=4, prefix_caching=False)
    kept = sim.add("kept", list(range(60, 73)), max_tokens=3)
    kept.keep_kv = True
    sim.run()
    assert len(kept.block_table) == 4
    sim.add("x", list(range(1, 29)), max_tokens=2)  # 7 blocks for its 28-token prompt
    h1 = sim.add_with_kv("h1", list(range(40, 49)), prefix_len=8)
    h2 = sim.add_with_kv("h2", list(range(50, 59)), prefix_len=8)
    out = sim.schedule()
    assert out.entries == [] and h1.num_preemptions == h2.num_preemptions == 0
    assert len(h1.block_table) == len(h2.block_table) == 2
    sim.sched.release("kept")  # exported: now dropping the newest stage's KV makes room
    out = sim.schedule()
    assert plan(out)[0] == ("x", 0, 28) and h2.num_preemptions == 1 and h1.num_preemptions == 0
