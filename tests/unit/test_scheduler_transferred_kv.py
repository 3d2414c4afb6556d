"""Scheduler properties with sequences whose KV arrived from another worker (later stages).

Random interleavings of plain requests, requests holding transferred KV (reserve + adopt
+ add, as `Engine.add_request(prefix_blocks=...)` does), aborts (finish + release, as
`Engine.abort` does) and steps, on small pools, driven through the model-free `Sim` of
test_scheduler.py (its `check_step` verifies budgets, max_num_seqs, ref counts and that
every step reads only its own tokens' KV).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from workers.engine.sequence import FinishReason, SequenceStatus
from workers.policies.base import Batch, BatchEntry

try:  # test_scheduler.py as pytest imports it (rootdir-less "prepend" mode) ...
    from test_scheduler import Sim, fake_token_at, plan
except ImportError:  # ... or as a package path (python -m pytest from the checkout)
    from tests.unit.test_scheduler import Sim, fake_token_at, plan

# fake_token_at(n): the fake model's token after n tokens; it depends only on the position.


class NoProgress(AssertionError):
    """The scheduler is in an endless loop (deadlock or livelock)."""


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    prefix_len: int | None = None  # KV of [0, prefix_len) arrived from another worker

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + self.max_tokens


class GreedyPolicy:
    """Asks for every running and every offered waiting sequence, all their tokens, in
    queue order, ignoring the budget and max_num_seqs: the scheduler must enforce both."""

    name = "greedy"

    def next_batch(self, running, waiting, budget, now):
        return Batch([BatchEntry(r.request_id, r.num_remaining_tokens) for r in [*running, *waiting]])

    def observe(self, executed):
        pass


@dataclass
class Config:
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    caching: bool
    greedy: bool = False  # GreedyPolicy instead of FcfsPolicy

    def sim(self) -> Sim:
        return Sim(self.num_blocks, self.block_size, self.budget, self.max_num_seqs, prefix_caching=self.caching,
                   policy=GreedyPolicy() if self.greedy else None)


def _state(sim: Sim):
    """Everything the next schedule() depends on (both policies ignore the clock; preemption
    counters are left out): equal states at two step starts mean an endless loop."""
    s, bm = sim.sched, sim.bm
    return (
        tuple(q.request_id for q in s.waiting),
        tuple(q.request_id for q in s.running),
        tuple((q.request_id, q.status, tuple(q.token_ids), tuple(q.block_table), q.num_computed_tokens)
              for q in s.sequences.values()),
        tuple(bm._free_plain),
        tuple(bm._free_cached),
        tuple((b.ref_count, b.block_hash) for b in bm.blocks),
    )


class Driver:
    """Runs one random interleaving and checks the transferred-KV properties on every step."""

    def __init__(self, cfg: Config, recover_known_deadlock: bool):
        self.cfg = cfg
        self.sim = cfg.sim()
        self.recover = recover_known_deadlock
        self.reqs: dict[str, Req] = {}
        self.seqs = {}
        self.adopted: dict[str, tuple[int, ...]] = {}  # a KV request's table as adopted
        self.first_start: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.forced_aborts = 0  # known-deadlock recoveries (only when recovering)
        self.drops = 0
        self.seen: set = set()  # states at step starts since the last add or abort

    # ---- operations --------------------------------------------------------------
    def add_plain(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self.seen.clear()
        self.seqs[req.rid] = self.sim.add(req.rid, req.prompt, max_tokens=req.max_tokens)

    def add_kv(self, req: Req) -> None:
        bm = self.sim.bm
        assert bm.blocks_for_tokens(req.prefix_len) <= bm.num_free_blocks
        self.reqs[req.rid] = req
        self.seen.clear()
        seq = self.sim.add_with_kv(req.rid, req.prompt, req.prefix_len, max_tokens=req.max_tokens)
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == req.prefix_len
        self.seqs[req.rid] = seq
        self.adopted[req.rid] = tuple(seq.block_table)

    def abort(self, rid: str) -> None:
        """As Engine.abort: finish (unless finished) then release."""
        sched = self.sim.sched
        seq = sched.sequences[rid]
        if not seq.is_finished:
            sched.finish(seq, FinishReason.ABORT)
        sched.release(rid)
        assert rid not in sched.sequences and seq.block_table == []
        assert seq not in sched.waiting and seq not in sched.running
        self.aborted.add(rid)
        self.seen.clear()

    def step(self) -> None:
        sim, sched = self.sim, self.sim.sched
        if sched.has_unfinished():
            state = _state(sim)
            if state in self.seen:  # deterministic: this loop never ends
                self._stuck()
                return
            self.seen.add(state)
        bm = sim.bm
        had_running = bool(sched.running)
        waiting_before = list(sched.waiting)
        head = waiting_before[0] if waiting_before else None
        holders = [s for s in waiting_before if s.block_table]
        preemptions_before = {s.request_id: s.num_preemptions for s in holders}
        # Expected drops: with nothing running, a KV-holding head that cannot grow by its
        # first chunk frees other holders' KV, newest first, only until it can.
        expected_drops = []
        if not had_running and head is not None and head.block_table:
            need = bm.blocks_to_grow(head, min(head.num_schedulable_tokens, sched.budget.max_num_batched_tokens))
            free = bm.num_free_blocks
            for h in reversed(holders[1:]):
                if free >= need:
                    break
                expected_drops.insert(0, h)
                free += sum(bm.blocks[b].ref_count == 1 for b in h.block_table)

        out = sim.schedule()  # Sim.check_step: budget, max_num_seqs, ref counts, KV isolation

        # (a dropped holder may be admitted again in the same step, from scratch)
        dropped = [s for s in holders if s.num_preemptions > preemptions_before[s.request_id]]
        assert not (dropped and had_running), "waiting KV dropped although a sequence was running"
        assert dropped == expected_drops, "waiting KV not dropped newest first, only as needed"
        self.drops += len(dropped)
        for s in dropped:
            assert s.num_preemptions == preemptions_before[s.request_id] + 1
            if s.status is SequenceStatus.WAITING:
                assert s.block_table == [] and s.num_computed_tokens == 0
        for s in holders:
            if s not in dropped and s.status is SequenceStatus.WAITING:
                assert s.block_table and s.num_computed_tokens > 0  # still holds its KV
        # FCFS: the sequences admitted this step are the head of the waiting queue, in order.
        admitted = [s for s in waiting_before if s.status is SequenceStatus.RUNNING]
        assert admitted == waiting_before[: len(admitted)], "a waiting sequence overtook a blocked one"

        for e in out.entries:
            rid = e.seq.request_id
            req = self.reqs[rid]
            if rid not in self.first_start:
                self.first_start[rid] = e.start
                if req.prefix_len is not None and e.seq.num_preemptions == 0:
                    assert e.start == req.prefix_len, f"{rid} recomputes transferred KV: {plan(out)}"
            if req.prefix_len is not None and e.seq.num_preemptions == 0:
                assert e.start >= req.prefix_len

        # A KV holder waiting with its KV keeps exactly the blocks it adopted.
        for s in sched.waiting:
            req = self.reqs[s.request_id]
            if req.prefix_len is not None and s.num_preemptions == 0:
                assert tuple(s.block_table) == self.adopted[s.request_id]
                assert s.num_computed_tokens == req.prefix_len

        sim.finish_step(out)

    def _stuck(self) -> None:
        sched, bm = self.sim.sched, self.sim.bm
        state = (f"waiting={[(s.request_id, len(s.block_table)) for s in sched.waiting]} "
                 f"running={[s.request_id for s in sched.running]} free={bm.num_free_blocks}")
        holders = [s for s in sched.waiting if s.block_table]
        if not (self.recover and holders):
            raise NoProgress(f"the scheduler loops forever: {state}")
        # The known bug (see the reproductions below): waiting KV holders keep blocks that
        # the head or the only running sequence needs, and only a KV-holding head with
        # nothing running ever drops them. Break the loop as a client would, by aborting
        # the newest holder, and go on checking everything else.
        self.forced_aborts += 1
        self.abort(holders[-1].request_id)

    def drain(self) -> None:
        remaining = sum(r.total_tokens for rid, r in self.reqs.items() if rid in self.sim.sched.sequences)
        bound = self.sim.steps + 4 * remaining + 4 * len(self.reqs) + 20
        while self.sim.sched.has_unfinished():
            assert self.sim.steps <= bound, f"not finished within {bound} steps"
            self.step()

    # ---- final checks ---------------------------------------------------------------
    def check_end(self) -> None:
        sim, cfg = self.sim, self.cfg
        finished = set(sim.finished)
        assert finished | self.aborted == set(self.reqs), "a request neither finished nor was aborted"
        assert not finished & self.aborted
        for rid in finished:
            req, seq = self.reqs[rid], self.seqs[rid]
            assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == req.max_tokens
            alone = run_alone(cfg, req)
            assert seq.token_ids == alone.token_ids, f"{rid}: output differs from running alone"
            if req.prefix_len is not None and seq.num_preemptions == 0:
                assert self.first_start[rid] == req.prefix_len
        assert sim.bm.num_free_blocks == cfg.num_blocks, "blocks leaked"
        assert all(b.ref_count == 0 for b in sim.bm.blocks)
        assert sim.sched.sequences == {} and not sim.sched.waiting and not sim.sched.running


def run_alone(cfg: Config, req: Req):
    sim = cfg.sim()
    if req.prefix_len is None:
        seq = sim.add(req.rid, req.prompt, max_tokens=req.max_tokens)
    else:
        seq = sim.add_with_kv(req.rid, req.prompt, req.prefix_len, max_tokens=req.max_tokens)
    sim.run(max_steps=4 * req.total_tokens + 10)
    # fake_token depends only on the position: alone, outputs are the positional tokens
    assert seq.output_ids == [fake_token_at(len(req.prompt) + k) for k in range(req.max_tokens)]
    assert sim.bm.num_free_blocks == cfg.num_blocks
    return seq


# ---- the random interleavings ---------------------------------------------------------

configs = st.builds(
    Config,
    block_size=st.integers(2, 4),
    num_blocks=st.integers(4, 12) | st.integers(4, 40),  # tight pools more often
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 4),
    caching=st.booleans(),
    greedy=st.booleans(),
)

OPS = ["plain", "kv", "kv", "abort"]


def draw_prompt(data, cfg: Config, base: list[int], max_tokens: int, min_len: int) -> list[int]:
    # Each request alone fits the pool: prompt + max_tokens tokens of KV at most.
    max_len = min(24, cfg.num_blocks * cfg.block_size - max_tokens)
    cut = data.draw(st.integers(0, min(len(base), max_len)), label="shared prefix")
    tail_len = data.draw(st.integers(max(0, min_len - cut), max_len - cut), label="tail length")
    tail = data.draw(st.lists(st.integers(0, 3), min_size=tail_len, max_size=tail_len), label="tail")
    return base[:cut] + tail


def interleave(data, cfg: Config, recover: bool, burst: int = 0) -> Driver:
    d = Driver(cfg, recover_known_deadlock=recover)
    base = data.draw(st.lists(st.integers(0, 3), max_size=16), label="base prompt")
    n_ops = data.draw(st.integers(1, 30), label="n_ops")
    # few steps between arrivals pile up waiting KV; many keep the pool busy
    ops = OPS + ["step"] * data.draw(st.integers(1, 4), label="step weight")
    for i in range(-burst, n_ops):  # a burst: later stages arrive before any step
        op = "kv" if i < 0 else data.draw(st.sampled_from(ops), label="op")
        rid = f"r{i}"
        if op == "plain":
            mt = data.draw(st.integers(1, 5), label="max_tokens")
            d.add_plain(Req(rid, draw_prompt(data, cfg, base, mt, 1), mt))
        elif op == "kv":
            mt = data.draw(st.integers(1, 5), label="max_tokens")
            prompt = draw_prompt(data, cfg, base, mt, 2)
            fits = min(len(prompt) - 1, d.sim.bm.num_free_blocks * cfg.block_size)
            if fits < 1:
                continue  # not enough free blocks to reserve even one
            # the longest KV that fits, often: the pool fills up with waiting KV
            prefix_len = data.draw(st.just(fits) | st.integers(1, fits), label="prefix_len")
            d.add_kv(Req(rid, prompt, mt, prefix_len))
        elif op == "abort":
            live = sorted(d.sim.sched.sequences)
            if live:
                d.abort(data.draw(st.sampled_from(live), label="abort"))
        else:
            d.step()
    d.drain()
    d.check_end()
    kv = [r for r in d.reqs.values() if r.prefix_len is not None]
    event(f"kv requests: {min(len(kv), 3)}+")
    event(f"kv finished without preemption: {sum(d.seqs[r.rid].num_preemptions == 0 for r in kv if r.rid in d.sim.finished) > 0}")
    event(f"waiting KV dropped: {d.drops > 0}")
    event(f"preemptions: {d.sim.sched.num_preemptions > 0}")
    event(f"forced aborts (known bug): {d.forced_aborts > 0}")
    event(f"finished: {min(len(d.sim.finished), 4)}+")
    return d


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.data())
def test_random_interleavings_with_transferred_kv_keep_invariants(cfg, data):
    """Every step passes check_step; waiting KV is dropped only when nothing runs, newest
    first; an undropped KV holder keeps its adopted blocks while waiting and starts at
    prefix_len; finished outputs equal running alone; all blocks end free; no endless
    loop other than the known bug below (broken here by aborting the newest KV holder)."""
    interleave(data, cfg, recover=True)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(2, 6), st.data())
def test_bursts_of_transferred_kv_filling_the_pool_keep_invariants(cfg, burst, data):
    """As above, starting with several later stages whose KV fills much of the pool, so
    that KV-holding heads with nothing running must drop the newer holders' KV."""
    interleave(data, cfg, recover=True, burst=burst)


@pytest.mark.xfail(strict=True, raises=NoProgress,
                   reason="BUG: KV held by waiting later stages can block a sequence without "
                          "blocks forever (deadlock) or make the only running one preempt itself "
                          "over and over (livelock): _drop_waiting_kv only runs for a KV-holding head")
@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.data())
def test_random_interleavings_with_transferred_kv_all_finish(cfg, data):
    """Liveness: with no intervention every request that fits the pool alone finishes."""
    interleave(data, cfg, recover=False)


# ---- minimal reproductions of the bug ---------------------------------------------------


@pytest.mark.xfail(strict=True, raises=NoProgress, reason="BUG: plain head blocked by a waiting KV holder, nothing runs")
def test_plain_head_blocked_by_waiting_kv_holders_deadlocks():
    # 4 blocks of 4. a (plain, 12 tokens: 3 blocks) arrives first; then b's KV (8 tokens,
    # 2 blocks) is reserved and adopted. a heads the queue and needs 3 blocks, 2 are free;
    # b may not overtake it; nothing runs, so nothing will ever free a block.
    cfg = Config(block_size=4, num_blocks=4, budget=64, max_num_seqs=4, caching=False)
    d = Driver(cfg, recover_known_deadlock=False)
    d.add_plain(Req("a", list(range(12)), 1))
    d.add_kv(Req("b", list(range(20, 29)), 1, prefix_len=8))
    d.drain()


@pytest.mark.xfail(strict=True, raises=NoProgress, reason="BUG: a self-preempted sequence is blocked by a waiting KV holder")
def test_running_sequence_preempted_by_waiting_kv_holder_deadlocks():
    # The same state reached from a running sequence: a runs with 2 blocks; b's KV takes
    # the other 2 and b waits (max_num_seqs=1). a needs a 3rd block at position 8, has no
    # victim, preempts itself, and then heads the queue needing 3 blocks with 2 free.
    cfg = Config(block_size=4, num_blocks=4, budget=64, max_num_seqs=1, caching=False)
    d = Driver(cfg, recover_known_deadlock=False)
    d.add_plain(Req("a", list(range(8)), 2))
    d.step()
    d.add_kv(Req("b", list(range(20, 26)), 1, prefix_len=5))
    d.drain()


@pytest.mark.xfail(strict=True, raises=NoProgress, reason="BUG: livelock, the only running sequence "
                   "preempts itself and is re-admitted chunk by chunk while a waiting KV holder keeps its block")
def test_chunked_prefill_livelocks_behind_a_waiting_kv_holder():
    # 3 blocks of 2, budget 2 tokens. a (4 prompt tokens + 2 outputs: 5 tokens of KV,
    # 3 blocks) runs; b's KV takes 1 block and b waits (max_num_seqs=1). a decodes at
    # position 4, needs its 3rd block, preempts itself; its 2-token chunk is admissible
    # again, so it recomputes [0, 4) and preempts itself again, forever.
    cfg = Config(block_size=2, num_blocks=3, budget=2, max_num_seqs=1, caching=False)
    d = Driver(cfg, recover_known_deadlock=False)
    d.add_plain(Req("a", [1, 2, 3, 4], 2))
    d.add_kv(Req("b", [5, 6], 1, prefix_len=1))
    d.drain()


def test_known_deadlock_recovers_when_the_holder_is_aborted():
    # The recovery the property test uses: aborting the waiting KV holder unblocks the head.
    cfg = Config(block_size=4, num_blocks=4, budget=64, max_num_seqs=4, caching=False)
    d = Driver(cfg, recover_known_deadlock=True)
    d.add_plain(Req("a", list(range(12)), 1))
    d.add_kv(Req("b", list(range(20, 29)), 1, prefix_len=8))
    d.drain()
    d.check_end()
    assert d.forced_aborts == 1 and d.aborted == {"b"} and set(d.sim.finished) == {"a"}


def test_kv_holders_only_all_added_before_a_step_finish_with_drops():
    # Deterministic companion of the existing drop test: three later stages fill the pool;
    # the head goes on, the newer ones' KV is dropped newest first and they recompute.
    cfg = Config(block_size=2, num_blocks=6, budget=64, max_num_seqs=4, caching=True)
    d = Driver(cfg, recover_known_deadlock=False)
    for i in range(3):
        d.add_kv(Req(f"k{i}", [10 * i + j for j in range(5)], 1, prefix_len=4))
    assert d.sim.bm.num_free_blocks == 0
    d.drain()
    d.check_end()
    assert d.drops >= 1 and set(d.sim.finished) == {"k0", "k1", "k2"}
    assert d.first_start["k0"] == 4
