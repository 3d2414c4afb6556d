"""Scheduler: token budget, running-first, chunked prefill, preemption, prefix hits, finishing.

The engine loop is simulated without a model: every entry that samples gets a
deterministic fake token (`update_from_output` appends it and finishes the stage after
max_tokens outputs). A fake KV store (block id -> token per slot) is written for every
scheduled token, so each step also checks that a sequence only ever attends to KV of its
own tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.core import (BlockManager, DecodeRun, ExecutedBatch, FcfsPolicy, FinishReason, KvInBlocks, KvPayload,
                             KvSink, PolicyContractError, SamplingParams, ScheduledEntry, Scheduler, SchedulerConfig,
                             SchedulerOutput, Sequence, SequenceStatus, StageKey, StageSpec, StepShape, TokenEvent)

VOCAB = 4096


def fake_token(seq: Sequence) -> int:
    """Deterministic 'model output': depends only on the position."""
    return (seq.num_tokens * 7 + 3) % 11


def fake_token_at(num_tokens_before: int) -> int:
    return (num_tokens_before * 7 + 3) % 11


def key(rid: str, stage: int = 0) -> StageKey:
    return StageKey(rid, stage)


class Sim:
    def __init__(self, num_blocks, block_size, max_tokens_per_step, max_num_seqs, prefix_caching=True,
                 policy=None):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.now = 0.0
        self.policy = policy or FcfsPolicy()
        config = SchedulerConfig(max_tokens_per_step, max_num_seqs, max_model_len=100_000, vocab_size=VOCAB)
        self.sched = Scheduler(config, self.bm, self.policy, lambda: self.now)
        self.kv: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.seqs: dict[str, Sequence] = {}
        self.finished: dict[str, Sequence] = {}
        self.steps = 0
        self.history: list[SchedulerOutput] = []

    def add(self, rid, prompt, max_tokens=4, arrival=None, keep_kv=False) -> Sequence:
        spec = StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival,
                               keep_kv=keep_kv)
        seq = self.sched.add_stage(spec)
        assert seq.key == key(rid) and seq.status is SequenceStatus.WAITING and seq in self.sched.waiting
        assert seq.arrival_time == (self.now if arrival is None else arrival)
        self.seqs[rid] = seq
        return seq

    def add_with_kv(self, rid, prompt, prefix_len, max_tokens=4) -> Sequence:
        """A later stage: KV of [0, prefix_len) arrived from another worker into reserved blocks."""
        blocks = self.sched.reserve_kv(prefix_len)
        assert len(blocks) == self.bm.blocks_for_tokens(prefix_len)
        bs = self.bm.block_size
        for pos in range(prefix_len):  # the transfer writes the other worker's KV
            self.kv[blocks[pos // bs]][pos % bs] = prompt[pos]
        spec = StageSpec(key(rid, 1), tuple(prompt), SamplingParams(max_tokens=max_tokens),
                         kv=KvInBlocks(tuple(blocks), prefix_len))
        seq = self.sched.add_stage(spec)
        assert seq.block_table == blocks and seq.num_computed_tokens == prefix_len
        self.seqs[rid] = seq
        return seq

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_step(out)
        return out

    def check_step(self, out: SchedulerOutput) -> None:
        sched, bm = self.sched, self.bm
        assert out.shape == StepShape.of((e.start, e.num_new_tokens, e.seq.prompt_len) for e in out.entries)
        assert out.num_tokens == sum(e.num_new_tokens for e in out.entries)
        assert out.num_tokens <= sched.budget.max_num_batched_tokens
        assert len(out.entries) <= sched.budget.max_num_seqs
        assert len(sched.running) <= sched.budget.max_num_seqs
        assert out.hold_until is None  # FCFS never holds work back
        keys = [e.seq.key for e in out.entries]
        assert len(keys) == len(set(keys)), "a sequence scheduled twice in one step"
        for e in out.entries:
            assert e.num_new_tokens >= 1
            assert e.seq.status is SequenceStatus.RUNNING and e.seq in sched.running
            assert e.start == e.seq.num_computed_tokens
            assert e.start + e.num_new_tokens <= e.seq.end
            assert len(e.seq.block_table) >= bm.blocks_for_tokens(e.start + e.num_new_tokens)
        for p in out.preempted:
            assert p.status is SequenceStatus.WAITING and p in sched.waiting
            assert p.block_table == [] and p.num_computed_tokens == 0
            assert p.key not in keys
        # ref counts == number of live sequences holding the block; free pools == ref 0
        holders = [0] * bm.num_blocks
        for s in sched.sequences.values():
            for b in s.block_table:
                holders[b] += 1
        for b in sched.session_pins.block_ids():  # a session's pinned history holds one reference
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
                    f"{seq.key} would attend to foreign KV at position {pos} (block {b})"
                )
            for pos in range(e.start, e.start + e.num_new_tokens):
                b = seq.block_table[pos // bs]
                assert holders[b] == 1, f"{seq.key} writes into block {b} shared with another sequence"
                assert (b, pos % bs) not in written
                written.add((b, pos % bs))
                self.kv[b][pos % bs] = seq.token_ids[pos]

    def finish_step(self, out: SchedulerOutput) -> list[TokenEvent]:
        live = [e for e in out.entries if self.sched.sequences.get(e.seq.key) is e.seq]
        sampled = {e.seq.key: fake_token(e.seq) for e in live if e.samples}
        events = self.sched.update_from_output(out, sampled, 0.01)
        # One event per sampled entry, in step order; chunks that sample nothing have none.
        assert [ev.key for ev in events] == list(sampled)
        for e in live:
            assert e.seq.num_computed_tokens == e.start + e.num_new_tokens or e.seq.is_finished
        for ev in events:
            seq = self.seqs[ev.request_id]
            assert ev.token_ids == [sampled[ev.key]] and seq.token_ids[-1] == sampled[ev.key]
            assert (ev.num_prompt_tokens, ev.num_output_tokens) == (seq.prompt_len, seq.num_output_tokens)
            if ev.finished:
                assert ev.finish_reason == "length" and seq.finish_reason is FinishReason.LENGTH
                assert seq.is_finished and seq.num_output_tokens == seq.params.max_tokens
                assert seq not in self.sched.running and seq not in self.sched.waiting
                assert (ev.key in self.sched.sequences) == seq.keep_kv
                self.finished[ev.request_id] = seq
            else:
                assert seq.num_output_tokens < seq.params.max_tokens and not seq.is_finished
        self.steps += 1
        self.now += 1.0
        return events

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


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len", "vocab_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_config_rejects_non_positive_limits(field, value):
    limits = dict(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, vocab_size=100)
    SchedulerConfig(**limits)
    with pytest.raises(ValueError, match=f"{field} must be > 0, got {value}"):
        SchedulerConfig(**{**limits, field: value})


def test_duplicate_stage_key_rejected_but_another_stage_of_the_request_is_not():
    sim = Sim(8, 4, 16, 4)
    a = sim.add("a", [1, 2])
    with pytest.raises(ValueError, match="already"):
        sim.add("a", [3])
    assert list(sim.sched.waiting) == [a] and sim.sched.sequences == {key("a"): a}
    # A migration landing where an earlier stage of the request still holds its KV.
    later = sim.sched.add_stage(StageSpec(key("a", 1), (1, 2), SamplingParams(max_tokens=4)))
    assert sim.sched.keys_of("a") == [key("a"), key("a", 1)] and sim.sched.keys_of("b") == []
    assert later.request_id == "a" and str(later.key) == "a/1"


def test_empty_scheduler_schedules_nothing():
    sim = Sim(8, 4, 16, 4)
    out = sim.schedule()
    assert out.entries == [] and out.preempted == [] and out.num_tokens == 0 and out.hold_until is None
    assert not sim.sched.has_unfinished()


# ---- add_stage validation (ValueErrors naming the field) ----------------------------


def _bad(spec_kwargs: dict, sampling: dict | None = None) -> StageSpec:
    base = dict(key=key("x"), prompt_ids=(1, 2, 3), sampling=SamplingParams(**(sampling or {})))
    return StageSpec(**{**base, **spec_kwargs})


@pytest.mark.parametrize("spec,text,message", [
    (_bad({"prompt_ids": ()}), None, "prompt must contain at least 1 token"),
    (_bad({"prompt_ids": (1, VOCAB, 2)}), None, rf"prompt token id {VOCAB} at index 1 is outside the vocabulary"),
    (_bad({"prompt_ids": (1, -1)}), None, "prompt token id -1 at index 1"),
    (_bad({"output_ids": (5, VOCAB + 1)}), None, "output_token_ids token id"),
    (_bad({}, {"max_tokens": 0}), None, "max_tokens must be an integer > 0"),
    (_bad({}, {"temperature": -0.5}), None, "temperature must be >= 0"),
    (_bad({}, {"top_p": 0.0}), None, "top_p must be in"),
    (_bad({}, {"top_k": -1}), None, "top_k must be >= 0"),
    (_bad({}, {"seed": -1}), None, "seed must be in"),
    (_bad({}, {"stop_token_ids": [VOCAB]}), None, "stop_token_ids must be in"),
    (_bad({}, {"stop": ["x"]}), None, "stop strings need a tokenizer"),
    (_bad({"prompt_ids": tuple(range(60))}, {"max_tokens": 5}), None, r"= 65 exceeds max_model_len \(64\)"),
    (_bad({"output_ids": (1, 2)}, {"max_tokens": 2}), None, r"output_token_ids \(2\) must be fewer than max_tokens"),
    (_bad({"prompt_ids": tuple(range(40))}, {"max_tokens": 20}), None, "exceeds the KV cache capacity"),
    (_bad({"kv": KvPayload(object(), 2)}), None, "kv: the scheduler takes KV already in blocks, got KvPayload"),
    (_bad({"kv": KvInBlocks((0,), 3)}), None, "kv covers 3 tokens; it must cover 1..2"),
    (_bad({"kv": KvInBlocks((0,), 0)}), None, "kv covers 0 tokens"),
    (_bad({"kv": KvInBlocks((0,), 2), "end": 2}), None, r"end \(2\) must be beyond the supplied KV"),
])
def test_add_stage_rejects_what_it_cannot_run_and_keeps_nothing(spec, text, message):
    sched = Scheduler(SchedulerConfig(16, 4, max_model_len=64, vocab_size=VOCAB), BlockManager(12, 4), FcfsPolicy(),
                      lambda: 0.0)
    with pytest.raises(ValueError, match=message):
        sched.add_stage(spec, text)
    assert sched.sequences == {} and not sched.waiting
    assert sched.block_manager.num_free_blocks == 12  # nothing adopted


def test_a_rejected_stage_with_kv_leaves_its_reserved_blocks_to_the_caller():
    sched = Scheduler(SchedulerConfig(16, 4, 64, VOCAB), BlockManager(8, 4), FcfsPolicy(), lambda: 0.0)
    blocks = sched.reserve_kv(5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sched.add_stage(StageSpec(key("x", 1), (1, 2, VOCAB, 4, 5, 6), kv=KvInBlocks(tuple(blocks), 5)))
    assert sched.block_manager.num_free_blocks == 6 and sched.sequences == {}
    sched.release_reserved(blocks)
    assert sched.block_manager.num_free_blocks == 8


def test_a_stage_without_a_seed_draws_one_from_the_configured_seed():
    def seeds(config_seed):
        sched = Scheduler(SchedulerConfig(16, 4, 64, VOCAB, seed=config_seed), BlockManager(8, 4), FcfsPolicy(),
                          lambda: 0.0)
        return [sched.add_stage(StageSpec.whole(r, [1], SamplingParams(seed=s))).seed
                for r, s in (("a", None), ("b", 7), ("c", None))]

    assert seeds(0) == seeds(0) and seeds(0)[1] == 7
    assert seeds(0)[0] != seeds(0)[2] and seeds(1)[0] != seeds(0)[0]


# ---- chunked prefill and decode --------------------------------------------------


def test_chunked_prefill_splits_prompt_with_correct_starts_then_decodes_one_token():
    sim = Sim(16, 4, 8, 4)
    a = sim.add("a", list(range(20)), max_tokens=3)
    steps = []
    while sim.sched.has_unfinished():
        out = sim.schedule()
        steps.append((plan(out), [e.samples for e in out.entries], out.shape))
        sim.finish_step(out)
    assert steps == [
        ([("a", 0, 8)], [False], StepShape(((0, 8),))),
        ([("a", 8, 8)], [False], StepShape(((8, 8),))),
        ([("a", 16, 4)], [True], StepShape(((16, 4),))),
        ([("a", 20, 1)], [True], StepShape((), 1, 21)),
        ([("a", 21, 1)], [True], StepShape((), 1, 22)),
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
        assert len(out.entries) == 4 and out.shape.is_decode_only
    assert not sim.sched.has_unfinished()


def test_samples_flag_only_on_chunk_reaching_the_end():
    seq = Sequence(key("x"), [1, 2, 3, 4, 5], 5, SamplingParams(), 0, 0.0)
    assert not ScheduledEntry(seq, 0, 4).samples
    assert ScheduledEntry(seq, 0, 5).samples
    assert ScheduledEntry(seq, 4, 1).samples
    out = SchedulerOutput.of([ScheduledEntry(seq, 0, 2), ScheduledEntry(seq, 2, 3)])
    assert out.num_tokens == 5 and out.shape == StepShape(((0, 2), (2, 3)))
    # One new token past the prompt is a decode; the prompt's last token alone is not.
    seq.token_ids.append(9)
    assert SchedulerOutput.of([ScheduledEntry(seq, 5, 1)]).shape == StepShape((), 1, 6)
    assert SchedulerOutput.of([ScheduledEntry(seq, 4, 1)]).shape == StepShape(((4, 1),))


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
    assert list(sim.sched.waiting) == [b, sim.sched.sequences[key("c")]]
    assert sim.sched.running == [a]
    assert b.token_ids == [4, 5, 6, fake_token_at(3), fake_token_at(4)]  # outputs are kept
    assert sim.sched.load().num_preemptions == 1
    sim.finish_step(out)
    sim.run()
    assert sim.finished["b"].num_output_tokens == 5
    assert sim.finished["a"].num_output_tokens == 5
    assert sim.finished["b"].output_ids == [fake_token_at(3 + k) for k in range(5)]
    assert sim.bm.num_free_blocks == 4


def test_preempted_sequence_is_recomputed_from_scratch_with_correct_starts():
    # 5 blocks of 2 (a request's 3 + 6 tokens must fit the cache: add_stage checks that now)
    sim = Sim(5, 2, 64, 8, prefix_caching=False)
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
    sim.add("a", [1, 2, 3], max_tokens=5)
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
    assert sim.sched.load().prefix_hit_rate == pytest.approx(8 / 20)
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
    assert sim.bm.num_free_blocks == 8 and len(sim.bm.free_cached_blocks) == 4
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
    assert sim.bm.num_free_blocks == 4 and len(sim.bm.free_cached_blocks) == 4
    c = sim.add("C", [1, 2, 3, 4, 6], max_tokens=1)
    out = sim.schedule()  # R decodes at 8 -> needs a 5th block -> evicts A's tail [3,4]
    assert c in sim.sched.running
    assert not set(r.block_table) & set(c.block_table)
    sim.finish_step(out)
    sim.run()
    assert c.num_output_tokens == 1


# ---- finishing / aborting --------------------------------------------------------


def test_finish_running_sequence_frees_its_blocks_and_the_step_in_flight_skips_it():
    sim = Sim(8, 4, 8, 4)
    a = sim.add("a", list(range(20)), max_tokens=4)
    out = sim.schedule()
    assert sim.bm.num_used_blocks == 2
    sim.sched.finish(a, FinishReason.ABORT)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert a not in sim.sched.running and key("a") not in sim.sched.sequences
    assert sim.bm.num_free_blocks == 8
    # the step that was in flight completes: the aborted sequence is skipped, even its token
    assert sim.sched.update_from_output(out, {a.key: 5}, 0.0) == []
    assert a.num_computed_tokens == 0 and a.token_ids == list(range(20))
    assert sim.bm.num_free_blocks == 8
    assert not sim.sched.has_unfinished()


def test_abort_waiting_sequence_removes_it_from_the_queue():
    sim = Sim(8, 4, 4, 1)
    sim.add("a", [1] * 6, max_tokens=2)
    b = sim.add("b", [2] * 6, max_tokens=2)
    sim.step()
    assert sim.sched.abort(key("b")) is True
    assert b.finish_reason is FinishReason.ABORT and list(sim.sched.waiting) == []
    assert key("b") not in sim.sched.sequences
    assert sim.sched.abort(key("b")) is False  # unknown now
    sim.run()
    assert "b" not in sim.finished


def test_abort_of_a_running_stage_mid_step_then_a_new_stage_with_its_key():
    sim = Sim(8, 4, 64, 4)
    a = sim.add("a", [1, 2, 3], max_tokens=3)
    out = sim.schedule()
    assert sim.sched.abort(key("a"))
    again = sim.add("a", [1, 2, 3], max_tokens=3)  # same key, a new sequence
    assert sim.sched.update_from_output(out, {key("a"): 4}, 0.0) == []  # the old entry is void
    assert again.num_computed_tokens == 0 and again.token_ids == [1, 2, 3] and a.token_ids == [1, 2, 3]
    sim.run()
    assert again.num_output_tokens == 3


def test_keep_kv_finished_sequence_holds_blocks_until_release():
    sim = Sim(8, 4, 64, 4)
    a = sim.add("a", list(range(6)), max_tokens=1, keep_kv=True)
    sim.run()
    assert a.is_finished and key("a") in sim.sched.sequences and sim.sched.keys_of("a") == [key("a")]
    assert sim.bm.num_used_blocks == 2
    assert sim.sched.kv_blocks(key("a")) == (a.block_table, 6)
    sim.sched.release(key("a"))
    assert sim.bm.num_free_blocks == 8 and key("a") not in sim.sched.sequences
    sim.sched.release(key("a"))  # unknown key: no-op
    with pytest.raises(KeyError):
        sim.sched.kv_blocks(key("a"))


def test_abort_frees_kept_kv_at_once():
    sim = Sim(8, 4, 64, 4)
    a = sim.add("a", list(range(6)), max_tokens=1, keep_kv=True)
    sim.run()
    assert sim.sched.abort(key("a")) and a.finish_reason is FinishReason.LENGTH  # finished before
    assert sim.bm.num_free_blocks == 8 and sim.sched.sequences == {}


class Text:
    """An OutputText: token t reads as letter t; `stop` strings end the stage."""

    def __init__(self, stop=()):
        self.stop, self.text, self.stopped, self.finals = list(stop), "", False, []

    def push(self, token_ids, final=False):
        new = "".join(chr(ord("a") + t) for t in token_ids)
        self.text += new
        self.finals.append(final)
        if any(s in self.text for s in self.stop):
            self.stopped = True
        return new


def _one_stage(sampling: SamplingParams, eos=frozenset(), text=None, **spec):
    sched = Scheduler(SchedulerConfig(64, 4, 256, VOCAB, eos_token_ids=eos), BlockManager(16, 4), FcfsPolicy(),
                      lambda: 0.0)
    seq = sched.add_stage(StageSpec.whole("r", [1, 2, 3], sampling, **spec), text)
    return sched, seq


def _feed(sched, tokens) -> list[TokenEvent]:
    """One step per token (each step samples it for every entry that samples); the events."""
    events = []
    for t in tokens:
        out = sched.schedule()
        events += sched.update_from_output(out, {e.seq.key: t for e in out.entries if e.samples}, 0.0)
    return events


@pytest.mark.parametrize("sampling,eos,tokens,reason,outputs", [
    (SamplingParams(max_tokens=3), frozenset(), [5, 6, 7, 8], "length", [5, 6, 7]),
    (SamplingParams(max_tokens=9), frozenset({6}), [5, 6, 7], "stop", [5, 6]),
    (SamplingParams(max_tokens=3, ignore_eos=True), frozenset({6}), [5, 6, 6, 7], "length", [5, 6, 6]),
    (SamplingParams(max_tokens=9, stop_token_ids=[7]), frozenset(), [5, 6, 7, 8], "stop", [5, 6, 7]),
    (SamplingParams(max_tokens=9, stop_token_ids=[7], ignore_eos=True), frozenset(), [5, 7], "stop", [5, 7]),
])
def test_update_from_output_finishes_on_eos_stop_ids_and_max_tokens(sampling, eos, tokens, reason, outputs):
    sched, seq = _one_stage(sampling, eos)
    events = _feed(sched, tokens)
    assert [ev.token_ids for ev in events] == [[t] for t in outputs]
    assert [ev.finish_reason for ev in events] == [None] * (len(outputs) - 1) + [reason]
    assert seq.output_ids == outputs and seq.finish_reason.value == reason
    assert sched.sequences == {} and sched.block_manager.num_free_blocks == 16


def test_stop_strings_finish_through_the_text_object():
    text = Text(stop=["gh"])
    sched, seq = _one_stage(SamplingParams(max_tokens=9, stop=["gh"]), text=text)
    events = _feed(sched, [5, 6, 7, 8])
    assert [(ev.text, ev.finish_reason) for ev in events] == [("f", None), ("g", None), ("h", "stop")]
    assert seq.finish_reason is FinishReason.STOP and text.finals == [False, False, False]
    # The last push of a stage that ends otherwise is marked final (flush held-back text).
    text = Text()
    sched, seq = _one_stage(SamplingParams(max_tokens=2), text=text)
    assert [ev.text for ev in _feed(sched, [0, 1])] == ["a", "b"] and text.finals == [False, True]


def test_a_prefill_stage_ends_with_its_first_token_and_keeps_kv_for_its_push():
    # PD disaggregation: stage [0, P) computes the prompt, samples the first output token
    # and stops; its KV stays until the push that reads it is done (release).
    sink = KvSink("decode-0", "t", (0, 1))
    sched, seq = _one_stage(SamplingParams(max_tokens=8), end=3, sink=sink)
    assert seq.stop_at == 3 and seq.keep_kv
    events = _feed(sched, [5])
    assert [(ev.token_ids, ev.finish_reason) for ev in events] == [([5], "stage_end")]
    assert seq.finish_reason is FinishReason.STAGE_END and sched.kv_blocks(seq.key) == (seq.block_table, 3)
    sched.release(seq.key)
    assert sched.block_manager.num_free_blocks == 16


def test_a_stage_ending_inside_the_prompt_samples_nothing():
    sched = Scheduler(SchedulerConfig(4, 4, 256, VOCAB), BlockManager(16, 4), FcfsPolicy(), lambda: 0.0)
    seq = sched.add_stage(StageSpec.whole("r", list(range(10)), SamplingParams(max_tokens=4), end=6, keep_kv=True))
    out = sched.schedule()
    assert [(e.start, e.num_new_tokens, e.samples) for e in out.entries] == [(0, 4, False)]
    assert sched.update_from_output(out, {}, 0.0) == []
    out = sched.schedule()
    assert [(e.start, e.num_new_tokens, e.samples) for e in out.entries] == [(4, 2, False)]  # not past the end
    events = sched.update_from_output(out, {}, 0.0)
    assert [(ev.token_ids, ev.finish_reason) for ev in events] == [([], "stage_end")]
    assert sched.kv_blocks(seq.key) == (seq.block_table, 6) and len(seq.block_table) == 2
    assert not sched.has_unfinished()


def test_a_split_stage_decodes_up_to_its_end_then_the_next_stage_continues_from_its_kv():
    # DynaServe: [0, s) on one worker with s past the prompt, then [s, L) with that KV.
    sched = Scheduler(SchedulerConfig(64, 4, 256, VOCAB), BlockManager(16, 4), FcfsPolicy(), lambda: 0.0)
    first = sched.add_stage(StageSpec(key("r"), (1, 2, 3), SamplingParams(max_tokens=6), end=5, keep_kv=True))
    events = _feed(sched, [10, 11, 12])
    assert [(ev.token_ids, ev.finish_reason) for ev in events] == [([10], None), ([11], None), ([12], "stage_end")]
    table, computed = sched.kv_blocks(first.key)
    assert computed == 5 and first.token_ids == [1, 2, 3, 10, 11, 12]
    blocks = sched.reserve_kv(computed)  # the next stage's worker (here the same one) gets a copy
    second = sched.add_stage(StageSpec(key("r", 1), (1, 2, 3), SamplingParams(max_tokens=6), output_ids=(10, 11, 12),
                                       kv=KvInBlocks(tuple(blocks), computed)))
    sched.release(first.key)
    out = sched.schedule()
    assert [(e.seq.key, e.start, e.num_new_tokens) for e in out.entries] == [(key("r", 1), 5, 1)]
    assert out.shape == StepShape((), 1, 6)
    events = sched.update_from_output(out, {second.key: 13}, 0.0)
    events += _feed(sched, [14, 15])
    # max_tokens counts the earlier stage's outputs: 3 more here, then LENGTH
    assert [ev.finish_reason for ev in events] == [None, None, "length"]
    assert second.output_ids == [10, 11, 12, 13, 14, 15] and events[-1].num_output_tokens == 6
    assert sched.block_manager.num_free_blocks == 16


def test_load_and_prefill_queue():
    sim = Sim(16, 4, 8, 4)
    sim.add("a", list(range(20)), max_tokens=2)
    sim.add("b", list(range(30, 35)), max_tokens=2)
    sim.now = 3.0
    out = sim.step()  # a: 8 of 20
    load = sim.sched.load()
    assert (load.running, load.waiting, load.queued_prefill_tokens) == (1, 1, 12 + 5)
    assert (load.free_blocks, load.total_blocks, load.block_size) == (14, 16, 4)
    assert [(t.l_hist, t.l_incr) for t in sim.sched.prefill_queue()] == [(8, 12), (0, 5)]
    assert [t.task_id for t in sim.sched.prefill_queue()] == ["a/0", "b/0"]
    assert plan(out) == [("a", 0, 8)]


# ---- policy plumbing -------------------------------------------------------------


class RecordingPolicy(FcfsPolicy):
    observes_steps = True  # observe() below records (FcfsPolicy's ignores its argument)

    def __init__(self):
        self.calls = []
        self.observed: list[ExecutedBatch] = []

    def next_batch(self, step, now):
        self.calls.append((list(step.running), list(step.waiting), step.budget, now, step.tokens_left, step.seqs_left))
        return super().next_batch(step, now)

    def observe(self, executed):
        self.observed.append(executed)


def test_policy_sees_cached_prefix_clock_and_gets_feedback():
    policy = RecordingPolicy()
    sim = Sim(16, 4, 64, 8, policy=policy)
    sim.add("a", list(range(10)), max_tokens=1)
    sim.now = 5.0
    out = sim.step()
    running, waiting, budget, now, tokens_left, seqs_left = policy.calls[-1]
    assert now == 5.0 and running == [] and budget.max_num_batched_tokens == 64 and budget.max_num_seqs == 8
    assert (tokens_left, seqs_left) == (64, 8)
    assert waiting[0].key == key("a") and waiting[0].arrival_time == 0.0
    assert waiting[0].num_computed_tokens == 0 and waiting[0].num_tokens == 10 and waiting[0].prompt_len == 10
    assert policy.observed[-1] == ExecutedBatch(StepShape(((0, 10),)), 0.01) and out.shape == StepShape(((0, 10),))
    sim.add("b", list(range(10)) + [1, 2], max_tokens=3)
    sim.step()
    _, waiting, _, _, _, _ = policy.calls[-1]
    assert waiting[0].num_computed_tokens == 8  # cached prefix reported to the policy
    assert policy.observed[-1] == ExecutedBatch(StepShape(((8, 4),)), 0.01)
    sim.step()  # decode of b
    running, waiting, _, _, _, seqs_left = policy.calls[-1]
    assert waiting == [] and [r.key for r in running] == [key("b")] and running[0].is_decode and seqs_left == 7
    assert policy.observed[-1] == ExecutedBatch(StepShape((), 1, 13), 0.01)


class ScriptedPolicy:
    """Adds exactly what it is told to, in order, and records what each add returned."""

    name = "scripted"

    def __init__(self, script):
        self.script = script
        self.granted: list[int] = []

    def next_batch(self, step, now):
        for rid, n in self.script:
            self.granted.append(step.add(key(rid), n))

    def observe(self, executed):
        pass


@pytest.mark.parametrize("script,message", [
    ([("ghost", 5)], "not in this step's queues"),  # unknown id
    ([("a", 20)], "exceed the 10 left"),  # more than the budget
    ([("a", 100)], r"num_tokens must be in \[1, 30\]"),  # more than the budget and than it has left
    ([("a", 3), ("a", 3)], "already in this step"),  # duplicate
    ([("b", 0)], r"num_tokens must be in \[1, 6\]"),  # nothing
    ([("b", 7)], r"num_tokens must be in \[1, 6\]"),  # more than it has left
])
def test_a_policy_breaking_the_contract_gets_an_error_not_a_repaired_step(script, message):
    # (The scheduler used to clamp and drop such entries; now a policy bug is loud.)
    sim = Sim(16, 4, 10, 4, policy=ScriptedPolicy(script))
    sim.add("a", list(range(30)), max_tokens=1)
    sim.add("b", list(range(6)), max_tokens=1)
    with pytest.raises(PolicyContractError, match=message):
        sim.sched.schedule()


def test_admitting_past_max_num_seqs_is_a_contract_error():
    policy = ScriptedPolicy([("a", 3)])
    sim = Sim(16, 4, 100, 2, policy=policy)
    for r in "abc":
        sim.add(r, [1, 2, 3], max_tokens=3)
    sim.step()
    policy.script = [("a", 1), ("b", 3), ("c", 3)]  # b and c are both in the window (2 waiting)
    with pytest.raises(PolicyContractError, match=r"stage c/0: admitting it exceeds max_num_seqs \(2\)"):
        sim.sched.schedule()
    assert policy.granted == [3, 1, 3]  # a ran, then a and b were granted before c broke the limit


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


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(shared_prefixes=False))
def test_random_mixes_run_to_completion(w):
    run_workload(*w)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
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
    sim.add_with_kv("b", list(range(30, 39)), prefix_len=8, max_tokens=2)
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
    kept = sim.add("kept", list(range(60, 73)), max_tokens=3, keep_kv=True)
    sim.run()
    assert len(kept.block_table) == 4
    sim.add("x", list(range(1, 29)), max_tokens=2)  # 7 blocks for its 28-token prompt
    h1 = sim.add_with_kv("h1", list(range(40, 49)), prefix_len=8)
    h2 = sim.add_with_kv("h2", list(range(50, 59)), prefix_len=8)
    out = sim.schedule()
    assert out.entries == [] and h1.num_preemptions == h2.num_preemptions == 0
    assert len(h1.block_table) == len(h2.block_table) == 2
    sim.sched.release(key("kept"))  # exported: now dropping the newest stage's KV makes room
    out = sim.schedule()
    assert plan(out)[0] == ("x", 0, 28) and h2.num_preemptions == 1 and h1.num_preemptions == 0


# ---- fast-forwarded decode runs (DecodeRun) ------------------------------------------


def _index_owners(sched: Scheduler) -> dict[int, tuple[str, int]]:
    """The prefix index by structure: hash -> (request id, block position) of the block holding it."""
    where = {b: (k.request_id, i) for k, s in sched.sequences.items() for i, b in enumerate(s.block_table)}
    return {h: where.get(b, ("free", -1)) for h, b in sched.block_manager._hash_to_block.items()}


def _stepped_and_fast_forwarded(make, steps: int):
    """The same scheduler after `steps` decode steps, stepped one by one and applied as a DecodeRun
    (every step samples token 1)."""
    stepped = make()
    for _ in range(steps):
        out = stepped.schedule()
        stepped.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
    fast = make()
    run = DecodeRun.find(fast, fast.schedule(), 1)
    assert run is not None and run.steps > steps
    run.apply(steps, [0.01] * run.steps)
    return stepped, fast


def _after_prefill(block_size: int, num_blocks: int, prompts: dict[str, tuple[list[int], int]]):
    def make():
        policy = RecordingPolicy()
        sched = Scheduler(SchedulerConfig(64, 8, 256, VOCAB), BlockManager(num_blocks, block_size), policy,
                          lambda: 0.0)
        for rid, (prompt, max_tokens) in prompts.items():
            sched.add_stage(StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens)))
        out = sched.schedule()
        sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
        return sched
    return make


def test_a_decode_run_applies_what_stepping_does():
    stepped, fast = _stepped_and_fast_forwarded(
        _after_prefill(2, 32, {"a": ([5, 6, 7], 9), "b": ([8, 9, 9, 9, 2], 9)}), 5)
    for k, s in stepped.sequences.items():
        f = fast.sequences[k]
        assert (f.token_ids, f.num_computed_tokens, len(f.block_table)) == (
            s.token_ids, s.num_computed_tokens, len(s.block_table))
    assert _index_owners(fast) == _index_owners(stepped)
    assert fast.block_manager.num_free_blocks == stepped.block_manager.num_free_blocks
    assert fast.policy.observed == stepped.policy.observed  # observe() per step, same shapes


def test_a_decode_run_indexes_equal_blocks_in_the_order_stepping_does():
    # Same content (prompt 5, 1, 1, then the sampled 1s): b is two tokens ahead of a, so it
    # fills block 2 ([1, 1] after [5, 1], [1, 1]) two steps before a does and holds its hash.
    stepped, fast = _stepped_and_fast_forwarded(
        _after_prefill(2, 32, {"a": ([5, 1, 1], 8), "b": ([5, 1, 1, 1, 1], 8)}), 4)
    assert sorted(_index_owners(stepped).values()) == [("a", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert _index_owners(fast) == _index_owners(stepped)


def test_a_decode_run_indexes_a_waiting_block_once_its_holder_is_evicted():
    # h and c compute block [7, 7, 7, 7] together; h holds its hash and finishes, its block
    # cached. In the run, a grows into the last free blocks and evicts h's; from then on
    # c's block is the only one with that prefix.
    make = _after_prefill(4, 5, {"h": ([7, 7, 7, 7, 9], 1), "c": ([7, 7, 7, 7, 8], 8), "a": ([3], 8)})
    stepped, fast = _stepped_and_fast_forwarded(make, 5)
    probe = Sequence(key("d"), [7, 7, 7, 7, 1], 5, SamplingParams(), 0, 0.0)
    assert len(stepped.block_manager.cached_prefix_blocks(probe)) == 1
    assert fast.block_manager.cached_prefix_blocks(probe) == stepped.block_manager.cached_prefix_blocks(probe)


def test_a_decode_run_without_prefix_caching_applies_in_bulk_and_hashes_nothing():
    # Without a prefix index no block is hashed (hashing every block a run fills was a sixth of
    # the simulator's time with prefix caching off) and nothing can make bulk differ from stepping.
    def make():
        sched = Scheduler(SchedulerConfig(64, 8, 256, VOCAB), BlockManager(32, 2, enable_prefix_caching=False),
                          RecordingPolicy(), lambda: 0.0)
        for rid, prompt in (("a", [5, 6, 7]), ("b", [5, 6, 7, 7, 2])):
            sched.add_stage(StageSpec.whole(rid, prompt, SamplingParams(max_tokens=9)))
        out = sched.schedule()
        sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
        return sched

    stepped, fast = _stepped_and_fast_forwarded(make, 6)
    assert _block_state(fast) == _block_state(stepped)
    assert all(s.block_hashes == [] for s in fast.sequences.values())
    run = DecodeRun.find(fast, fast.schedule(), 1)
    assert run is not None and run._apply_in_bulk(1)  # bulk, not the step-by-step replay


def _block_state(sched: Scheduler) -> tuple:
    """Everything of the block manager and sequences a decode run may touch, block ids included."""
    bm = sched.block_manager
    return ({k: (s.token_ids, s.num_computed_tokens, s.block_table) for k, s in sched.sequences.items()},
            list(bm.free_plain_blocks), list(bm.free_cached_blocks), dict(bm._hash_to_block),
            [(b.ref_count, b.block_hash) for b in bm.blocks], bm.num_evictions)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.integers(1, 4), data=st.data())
def test_a_decode_run_equals_stepping_block_for_block(block_size, data):
    """Shared prefixes (a 3-token alphabet), cached free blocks left by finished requests (so
    growth evicts), sequences at every offset within a block: after any number of steps the
    fast-forwarded scheduler holds the same blocks, by id, indexed the same way."""
    alphabet = st.integers(1, 3)
    finished = data.draw(st.lists(st.lists(alphabet, min_size=1, max_size=12), max_size=4), label="finished")
    running = data.draw(st.lists(st.lists(alphabet, min_size=1, max_size=12), min_size=1, max_size=5),
                        label="running")
    max_tokens = data.draw(st.lists(st.integers(4, 24), min_size=len(running), max_size=len(running)))
    need = sum(-(-(len(p) + m) // block_size) for p, m in zip(running, max_tokens))
    num_blocks = need + data.draw(st.integers(0, 6), label="spare blocks")
    caching = data.draw(st.booleans(), label="prefix caching")

    def make() -> Scheduler:
        sched = Scheduler(SchedulerConfig(4096, 16, 256, VOCAB), BlockManager(num_blocks, block_size, caching),
                          RecordingPolicy(), lambda: 0.0)
        for i, prompt in enumerate(finished):  # leave their full blocks cached and free
            if len(prompt) + 1 <= num_blocks * block_size:
                sched.add_stage(StageSpec.whole(f"f{i}", prompt, SamplingParams(max_tokens=1)))
                while sched.has_unfinished():
                    out = sched.schedule()
                    sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
        for i, (prompt, m) in enumerate(zip(running, max_tokens)):
            sched.add_stage(StageSpec.whole(f"r{i}", prompt, SamplingParams(max_tokens=m)))
        out = sched.schedule()  # every prompt in one step: the next steps are decodes
        sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
        return sched

    probe = make()
    run = DecodeRun.find(probe, probe.schedule(), 1)
    if run is None or run.steps < 2:
        return  # not a steady run (a prompt did not fit in one step, or a sequence ends next step)
    steps = data.draw(st.integers(1, run.steps - 1), label="steps applied")
    stepped, fast = _stepped_and_fast_forwarded(make, steps)
    assert _block_state(fast) == _block_state(stepped)
    assert fast.policy.observed == stepped.policy.observed


def test_kv_short_says_a_stage_already_here_was_left_without_blocks():
    """`kv_short`: the last step refused a waiting stage admission, or preempted, for want of
    blocks; the engine loop then grants no KV reservation for another worker's push, so
    blocks that free go to the stages already here first."""
    s = Sim(num_blocks=4, block_size=4, max_tokens_per_step=64, max_num_seqs=4)
    s.add("a", list(range(12)), max_tokens=2)  # 3 blocks
    s.step()
    assert not s.sched.kv_short  # it fit
    s.add("b", list(range(100, 112)), max_tokens=2)  # 3 more: 1 is free
    s.step()
    assert s.sched.kv_short and s.seqs["b"].status is SequenceStatus.WAITING
    s.run()  # "a" finishes, "b" is admitted and finishes
    assert not s.sched.kv_short and s.seqs["b"].num_output_tokens == 2

    reserved = s.sched.reserve_kv(16)  # every block held for an incoming push
    s.add("c", list(range(200, 204)), max_tokens=1)
    assert s.sched.schedule().entries == [] and s.sched.kv_short  # (Sim.step's checks know no reservations)
    s.sched.release_reserved(reserved)
    s.run()
    assert not s.sched.kv_short and s.seqs["c"].num_output_tokens == 1
