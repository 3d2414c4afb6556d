"""Scheduler properties with sequences whose KV arrived from another worker (later stages).

Random interleavings of plain requests, later stages holding transferred KV
(`reserve_kv`, then `add_stage(StageSpec(..., kv=KvInBlocks(...)))`, as the engine does
with a completed transfer), aborts (`Scheduler.abort`) and steps, on small pools, driven
through the model-free `Sim` of test_scheduler.py (its `check_step` verifies budgets,
max_num_seqs, ref counts and that every step reads only its own tokens' KV; its
`finish_step` checks every step's token events), under FCFS and under a policy that skips
a blocked waiting request.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitserve.core import FinishReason, SequenceStatus, StageKey

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


class SkippingPolicy:
    """FCFS without head-of-line blocking: a waiting request that finds no KV memory is
    skipped and the ones behind it are tried, and it keeps asking after a preemption (the
    scheduler itself must then admit nothing). Records what each waiting request got."""

    name = "skipping"

    def __init__(self):
        self.waiting_grants: list[tuple[StageKey, int]] = []  # this step's

    def next_batch(self, step, now):
        self.waiting_grants = []
        for r in step.running:
            if step.tokens_left:
                step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))
        for r in step.waiting:
            if not step.tokens_left or not step.seqs_left:
                break
            self.waiting_grants.append((r.key, step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))))

    def observe(self, executed):
        pass


@dataclass
class Config:
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    caching: bool
    skipping: bool = False  # SkippingPolicy instead of FcfsPolicy

    def sim(self) -> Sim:
        return Sim(self.num_blocks, self.block_size, self.budget, self.max_num_seqs, prefix_caching=self.caching,
                   policy=SkippingPolicy() if self.skipping else None)


def _state(sim: Sim):
    """Everything the next schedule() depends on (both policies ignore the clock; preemption
    counters are left out): equal states at two step starts mean an endless loop."""
    s, bm = sim.sched, sim.bm
    return (
        tuple(q.request_id for q in s.waiting),
        tuple(q.request_id for q in s.running),
        tuple((q.request_id, q.status, tuple(q.token_ids), tuple(q.block_table), q.num_computed_tokens)
              for q in s.sequences.values()),
        tuple(bm.free_plain_blocks),
        tuple(bm.free_cached_blocks),
        tuple((b.ref_count, b.block_hash) for b in bm.blocks),
    )


class Driver:
    """Runs one random interleaving and checks the transferred-KV properties on every step."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sim = cfg.sim()
        self.reqs: dict[str, Req] = {}
        self.seqs = {}
        self.adopted: dict[str, tuple[int, ...]] = {}  # a KV request's table as adopted
        self.first_start: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.drops = 0
        self.overtakes = 0  # steps where a waiting request was admitted past one that got nothing
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

    def abort(self, key: StageKey) -> None:
        """As Engine.abort: finish (unless finished) and release at once."""
        sched = self.sim.sched
        seq = sched.sequences[key]
        assert sched.abort(key)
        assert key not in sched.sequences and seq.block_table == [] and seq.is_finished
        assert seq not in sched.waiting and seq not in sched.running
        self.aborted.add(key.request_id)
        self.seen.clear()

    def step(self) -> None:
        sim, sched = self.sim, self.sim.sched
        if sched.has_unfinished():
            state = _state(sim)
            if state in self.seen:  # deterministic: this loop never ends
                raise NoProgress(f"the scheduler loops forever: waiting="
                                 f"{[(q.request_id, len(q.block_table)) for q in sched.waiting]} "
                                 f"running={[q.request_id for q in sched.running]} free={sim.bm.num_free_blocks}")
            self.seen.add(state)
        running_before = len(sched.running)
        waiting_before = list(sched.waiting)
        holders = [s for s in waiting_before if s.block_table]
        preemptions_before = {s.request_id: s.num_preemptions for s in holders}

        out = sim.schedule()  # Sim.check_step: budget, max_num_seqs, ref counts, KV isolation

        # Waiting KV is dropped only where nothing else would free a block: nothing running,
        # or the only running sequence about to preempt itself; and newest first, never that
        # of the stage being admitted (under FCFS the head, so the oldest holder).
        # (a dropped holder may be admitted again in the same step, from scratch)
        dropped = [s for s in holders if s.num_preemptions > preemptions_before[s.request_id]]
        assert not (dropped and running_before > 1), "waiting KV dropped although others were running"
        if self.cfg.skipping:
            kept = [None] + [s for s in holders if s not in dropped and s.status is SequenceStatus.RUNNING]
            assert any(dropped == (rest := [h for h in holders if h is not k])[len(rest) - len(dropped):]
                       for k in kept), "waiting KV not dropped newest first"
        else:
            assert dropped == holders[len(holders) - len(dropped):], "waiting KV not dropped newest first"
        self.drops += len(dropped)
        for s in dropped:
            assert s.num_preemptions == preemptions_before[s.request_id] + 1
            if s.status is SequenceStatus.WAITING:
                assert s.block_table == [] and s.num_computed_tokens == 0
        for s in holders:
            if s not in dropped and s.status is SequenceStatus.WAITING:
                assert s.block_table and s.num_computed_tokens > 0  # still holds its KV
        admitted = [s for s in waiting_before if s.status is SequenceStatus.RUNNING]
        if out.preempted:  # memory is short this step: admitting would only thrash
            assert admitted == [], "a waiting sequence was admitted in a step that preempted"
        if self.cfg.skipping:
            # Admitted exactly the requests whose add was granted, in the order asked.
            grants = sim.policy.waiting_grants
            assert [s.key for s in admitted] == [k for k, g in grants if g]
            self.overtakes += any(g and any(not g0 for _, g0 in grants[:i]) for i, (_, g) in enumerate(grants))
        else:
            # FCFS: the sequences admitted this step are the head of the waiting queue, in order.
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

    def drain(self) -> None:
        live = {k.request_id for k in self.sim.sched.sequences}
        remaining = sum(r.total_tokens for rid, r in self.reqs.items() if rid in live)
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
    skipping=st.booleans(),
)

OPS = ["plain", "kv", "kv", "abort"]


def draw_prompt(data, cfg: Config, base: list[int], max_tokens: int, min_len: int) -> list[int]:
    # Each request alone fits the pool: prompt + max_tokens tokens of KV at most.
    max_len = min(24, cfg.num_blocks * cfg.block_size - max_tokens)
    cut = data.draw(st.integers(0, min(len(base), max_len)), label="shared prefix")
    tail_len = data.draw(st.integers(max(0, min_len - cut), max_len - cut), label="tail length")
    tail = data.draw(st.lists(st.integers(0, 3), min_size=tail_len, max_size=tail_len), label="tail")
    return base[:cut] + tail


def interleave(data, cfg: Config, burst: int = 0) -> Driver:
    d = Driver(cfg)
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
    event(f"a skipped head was overtaken: {d.overtakes > 0}")
    event(f"finished: {min(len(d.sim.finished), 4)}+")
    return d


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.data())
def test_random_interleavings_with_transferred_kv_keep_invariants(cfg, data):
    """Every step passes check_step; waiting KV is dropped only where nothing else frees a
    block, newest first; an undropped KV holder keeps its adopted blocks while waiting and
    starts at prefix_len; every request finishes (no deadlock, no livelock) with the output
    it has alone; all blocks end free."""
    interleave(data, cfg)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(2, 6), st.data())
def test_bursts_of_transferred_kv_filling_the_pool_keep_invariants(cfg, burst, data):
    """As above, starting with several later stages whose KV fills much of the pool."""
    interleave(data, cfg, burst=burst)


# ---- regressions: the endless loops waiting KV once caused (found by the tests above) ----


def test_plain_head_behind_which_kv_waits_is_admitted():
    # 4 blocks of 4. a (plain, 12 tokens: 3 blocks) arrives first; then b's KV (8 tokens,
    # 2 blocks) is reserved and adopted. a heads the queue and needs 3 blocks, 2 are free;
    # b may not overtake it and nothing runs: b's KV is dropped so that a can go.
    cfg = Config(block_size=4, num_blocks=4, budget=64, max_num_seqs=4, caching=False)
    d = Driver(cfg)
    d.add_plain(Req("a", list(range(12)), 1))
    d.add_kv(Req("b", list(range(20, 29)), 1, prefix_len=8))
    d.drain()
    d.check_end()
    assert d.drops == 1 and set(d.sim.finished) == {"a", "b"}


def test_only_running_sequence_drops_waiting_kv_rather_than_preempting_itself():
    # a runs with 2 blocks; b's KV takes the other 2 and b waits (max_num_seqs=1). a needs
    # a 3rd block at position 8: preempting itself would leave it blocked behind b's KV.
    cfg = Config(block_size=4, num_blocks=4, budget=64, max_num_seqs=1, caching=False)
    d = Driver(cfg)
    d.add_plain(Req("a", list(range(8)), 2))
    d.step()
    d.add_kv(Req("b", list(range(20, 26)), 1, prefix_len=5))
    d.drain()
    d.check_end()
    assert d.seqs["a"].num_preemptions == 0 and d.seqs["b"].num_preemptions == 1


def test_chunked_prefill_does_not_livelock_behind_waiting_kv():
    # 3 blocks of 2, budget 2 tokens. a (4 prompt tokens + 2 outputs: 3 blocks) runs; b's
    # KV takes 1 block and b waits (max_num_seqs=1). a decodes at position 4 and needs its
    # 3rd block: preempting itself, it would recompute [0, 4) and come back to the same wall.
    cfg = Config(block_size=2, num_blocks=3, budget=2, max_num_seqs=1, caching=False)
    d = Driver(cfg)
    d.add_plain(Req("a", [1, 2, 3, 4], 2))
    d.add_kv(Req("b", [5, 6], 1, prefix_len=1))
    d.drain()
    d.check_end()
    assert set(d.sim.finished) == {"a", "b"}


def test_kv_holders_only_all_added_before_a_step_finish_with_drops():
    # Three later stages fill the pool; the head goes on, the newer ones' KV is dropped
    # newest first and they recompute.
    cfg = Config(block_size=2, num_blocks=6, budget=64, max_num_seqs=4, caching=True)
    d = Driver(cfg)
    for i in range(3):
        d.add_kv(Req(f"k{i}", [10 * i + j for j in range(5)], 1, prefix_len=4))
    assert d.sim.bm.num_free_blocks == 0
    d.drain()
    d.check_end()
    assert d.drops >= 1 and set(d.sim.finished) == {"k0", "k1", "k2"}
    assert d.first_start["k0"] == 4
