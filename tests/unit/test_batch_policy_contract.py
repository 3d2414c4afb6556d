"""The local batch-policy contract, on the real core `Scheduler` (no fakes).

A policy builds each step only through the `StepBuilder` it is handed (`step.add`,
`step.preempt`, `step.hold_until`, and the read-only `running` / `waiting` views and
budget figures); none of the policies below touches the scheduler itself. They show that
the contract is enough to:

* reorder — waiting requests in reverse, by a key (deadline), and AMPD-style look-ahead
  within a window with a cap on how often a request may be passed over;
* hold back — leave requests waiting and ask to be called again at a time (LAPS-style
  batching window); the step is empty and carries `hold_until`;
* budget — DynaServe-style decodes first, then a prefill token budget smaller than the
  step's, chunked; and a dLLM-style cost where a request takes its whole remaining
  sequence or nothing;
* preempt — make room for a more urgent request;

and that every breach of the contract raises `PolicyContractError`.
"""

from __future__ import annotations

import pytest

from splitserve.core import (BlockManager, DecodeRun, ExecutedBatch, FcfsPolicy, PolicyContractError, SamplingParams,
                             Scheduler, SchedulerConfig, SchedulerOutput, SequenceStatus, StageKey, StageSlo,
                             StageSpec, StepBuilder, StepShape)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def k(rid: str) -> StageKey:
    return StageKey(rid, 0)


def make(policy, *, num_blocks=64, block_size=4, budget=64, max_num_seqs=8, caching=True):
    clock = Clock()
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len=4096, vocab_size=4096),
                      BlockManager(num_blocks, block_size, caching), policy, clock)
    return sched, clock


_next_token = iter(range(100, 10**6))


def add(sched, rid, prompt_len, max_tokens=4, **spec):
    """A request with a prompt of its own (no prefix shared with any other)."""
    prompt = [next(_next_token) % 4000 for _ in range(prompt_len)]
    return sched.add_stage(StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens), **spec))


def step(sched) -> SchedulerOutput:
    """Schedule and execute one step (every sampled token is 1)."""
    out = sched.schedule()
    sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(e.seq.request_id, e.start, e.num_new_tokens) for e in out.entries]


def run_all(sched, max_steps=1000) -> int:
    steps = 0
    while sched.has_unfinished():
        assert steps < max_steps, "no progress"
        step(sched)
        steps += 1
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return steps


def add_running(step: StepBuilder) -> None:
    """Every running request, all it has left (decodes: one token), as far as the budget goes."""
    for r in step.running:
        if step.tokens_left:
            step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))


class Base:
    name = "test"
    observes_steps = True

    def __init__(self):
        self.observed: list[ExecutedBatch] = []

    def observe(self, executed: ExecutedBatch) -> None:
        self.observed.append(executed)


# ---- reorder ----------------------------------------------------------------------


class ReversePolicy(Base):
    """Newest waiting request first."""

    def next_batch(self, step: StepBuilder, now: float) -> None:
        add_running(step)
        for r in reversed(step.waiting):
            if step.tokens_left and step.seqs_left:
                step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))


class SortedPolicy(Base):
    """Waiting requests by a key (here: earliest TTFT deadline first), chunked to the budget."""

    def __init__(self, key):
        super().__init__()
        self.key = key

    def next_batch(self, step: StepBuilder, now: float) -> None:
        add_running(step)
        for r in sorted(step.waiting, key=self.key):
            if step.tokens_left and step.seqs_left:
                step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))


def test_a_policy_can_admit_waiting_requests_in_reverse():
    sched, _ = make(ReversePolicy())
    for rid in "abc":
        add(sched, rid, 3)
    assert plan(step(sched)) == [("c", 0, 3), ("b", 0, 3), ("a", 0, 3)]
    assert [s.request_id for s in sched.running] == ["c", "b", "a"]  # running in admission order
    assert plan(step(sched)) == [("c", 3, 1), ("b", 3, 1), ("a", 3, 1)]
    add(sched, "d", 2)
    add(sched, "e", 2)
    assert plan(step(sched)) == [("c", 4, 1), ("b", 4, 1), ("a", 4, 1), ("e", 0, 2), ("d", 0, 2)]


def test_a_policy_can_order_by_a_key_it_is_shown():
    # Earliest TTFT deadline first: the policy sees arrival + objective for each request.
    sched, clock = make(SortedPolicy(key=lambda r: r.ttft_deadline), budget=8)
    add(sched, "relaxed", 6, slo=StageSlo(ttft_s=10.0))
    clock.now = 1.0
    add(sched, "urgent", 6, slo=StageSlo(ttft_s=2.0))  # deadline 3.0 < 10.0
    add(sched, "middle", 6, slo=StageSlo(ttft_s=4.0))  # deadline 5.0
    out = step(sched)
    assert plan(out) == [("urgent", 0, 6), ("middle", 0, 2)]  # relaxed, first in the queue, waits
    assert [s.request_id for s in sched.waiting] == ["relaxed"]
    assert plan(step(sched)) == [("urgent", 6, 1), ("middle", 2, 4), ("relaxed", 0, 3)]


class LookaheadPolicy(Base):
    """AMPD-style look-ahead (Alg. 2): among the first `window` waiting requests, admit those
    whose whole prompt fits what is left of the budget, shortest first; a request passed over
    `cap` times is admitted first, in chunks, so that nothing starves."""

    def __init__(self, window: int, cap: int):
        super().__init__()
        self.window, self.cap = window, cap
        self.passed_over: dict[StageKey, int] = {}
        self.chunked: list[StageKey] = []

    def next_batch(self, step: StepBuilder, now: float) -> None:
        add_running(step)
        candidates = step.waiting[: self.window]
        forced = [r for r in candidates if self.passed_over.get(r.key, 0) >= self.cap]
        others = sorted((r for r in candidates if r not in forced), key=lambda r: r.num_remaining_tokens)
        admitted = set()
        for r in forced:
            if step.tokens_left and step.seqs_left and step.add(r.key, min(r.num_remaining_tokens, step.tokens_left)):
                admitted.add(r.key)
                self.chunked.append(r.key)
        for r in others:
            fits = step.seqs_left and r.num_remaining_tokens <= step.tokens_left
            if fits and step.add(r.key, r.num_remaining_tokens):
                admitted.add(r.key)
        for r in candidates:
            if r.key in admitted:
                self.passed_over.pop(r.key, None)
            else:
                self.passed_over[r.key] = self.passed_over.get(r.key, 0) + 1


def test_look_ahead_reorders_within_its_window_and_caps_postponement():
    policy = LookaheadPolicy(window=3, cap=2)
    sched, _ = make(policy, budget=8)
    add(sched, "long", 20, max_tokens=2)
    for i in range(1, 6):
        add(sched, f"s{i}", 3, max_tokens=6)
    # Step 1: long does not fit whole; s1 and s2 (in the window) do; s3 is beyond the window.
    assert plan(step(sched)) == [("s1", 0, 3), ("s2", 0, 3)]
    # Step 2: decodes, then s3 and s4 (the window is now long, s3, s4): long passed over again.
    assert plan(step(sched)) == [("s1", 3, 1), ("s2", 3, 1), ("s3", 0, 3), ("s4", 0, 3)]
    assert policy.passed_over == {k("long"): 2}
    # Step 3: long reached the cap: it goes first, chunked to what the decodes leave; s5,
    # shorter and next in the window, waits.
    out = step(sched)
    assert plan(out) == [("s1", 4, 1), ("s2", 4, 1), ("s3", 3, 1), ("s4", 3, 1), ("long", 0, 4)]
    assert policy.chunked == [k("long")] and policy.passed_over == {k("s5"): 1}
    # Now running, long goes on in chunks beside the decodes; everything finishes.
    assert plan(step(sched))[-1] == ("long", 4, 4)
    run_all(sched)


def test_the_waiting_view_is_the_queue_head_up_to_max_num_seqs():
    seen = []

    class Peek(Base):
        def next_batch(self, step, now):
            seen.append([r.key.request_id for r in step.waiting])

    sched, _ = make(Peek(), max_num_seqs=3)
    for rid in "abcde":
        add(sched, rid, 2)
    sched.schedule()
    assert seen == [["a", "b", "c"]]


# ---- hold back ----------------------------------------------------------------------


class BatchingWindowPolicy(Base):
    """LAPS-style AWD batching: with nothing running, wait (up to `wait_s` after the oldest
    arrival) for `min_batch` waiting requests before starting; then FCFS."""

    def __init__(self, min_batch: int, wait_s: float):
        super().__init__()
        self.min_batch, self.wait_s = min_batch, wait_s

    def next_batch(self, step: StepBuilder, now: float) -> None:
        if not step.running and step.waiting and len(step.waiting) < self.min_batch:
            deadline = min(r.arrival_time for r in step.waiting) + self.wait_s
            if now < deadline:
                step.hold_until(deadline)
                return
        FcfsPolicy().next_batch(step, now)


def test_a_policy_can_hold_work_back_until_a_time():
    policy = BatchingWindowPolicy(min_batch=3, wait_s=0.5)
    sched, clock = make(policy)
    a = add(sched, "a", 4)
    out = sched.schedule()
    assert out.entries == [] and out.preempted == [] and out.hold_until == 0.5 and out.shape == StepShape()
    # Nothing ran: a still waits, holds no blocks, has computed nothing.
    assert list(sched.waiting) == [a] and a.status is SequenceStatus.WAITING
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    clock.now = 0.3
    add(sched, "b", 4)
    out = sched.schedule()
    assert out.entries == [] and out.hold_until == 0.5  # the oldest request's deadline
    clock.now = 0.5  # the driver comes back by hold_until: the window is over
    out = step(sched)
    assert plan(out) == [("a", 0, 4), ("b", 0, 4)] and out.hold_until is None
    run_all(sched)


def test_a_full_batch_is_not_held_back_and_the_earliest_hold_wins():
    sched, clock = make(BatchingWindowPolicy(min_batch=2, wait_s=5.0))
    add(sched, "a", 4)
    clock.now = 1.0
    add(sched, "b", 4)
    assert plan(step(sched)) == [("a", 0, 4), ("b", 0, 4)]  # two waiting: no reason to wait

    class TwoHolds(Base):
        def next_batch(self, step, now):
            step.hold_until(7.0)
            step.hold_until(3.0)
            step.hold_until(9.0)

    sched, _ = make(TwoHolds())
    add(sched, "a", 4)
    assert sched.schedule().hold_until == 3.0


# ---- budget -------------------------------------------------------------------------


class DecodeFirstPolicy(Base):
    """DynaServe-style (Alg. 2): every decode first, then prefill (running chunks, then
    waiting requests) within a prefill budget M smaller than the step's token budget."""

    def __init__(self, prefill_budget: int):
        super().__init__()
        self.prefill_budget = prefill_budget

    def next_batch(self, step: StepBuilder, now: float) -> None:
        for r in step.running:
            if r.is_decode and step.tokens_left:
                step.add(r.key, 1)
        left = self.prefill_budget
        for r in [r for r in step.running if not r.is_decode] + list(step.waiting):
            n = min(r.num_remaining_tokens, left, step.tokens_left)
            if n <= 0:
                break
            if r in step.waiting and not step.seqs_left:
                break
            left -= step.add(r.key, n)


def test_decodes_first_then_a_prefill_budget_smaller_than_the_step_budget():
    policy = DecodeFirstPolicy(prefill_budget=10)
    sched, _ = make(policy, budget=64)
    add(sched, "d1", 2, max_tokens=12)
    add(sched, "d2", 3, max_tokens=12)
    step(sched)  # both prompts (5 tokens of prefill)
    add(sched, "p", 25, max_tokens=2)
    add(sched, "q", 7, max_tokens=2)
    outs = [step(sched) for _ in range(4)]
    assert [plan(o) for o in outs] == [
        [("d1", 2, 1), ("d2", 3, 1), ("p", 0, 10)],
        [("d1", 3, 1), ("d2", 4, 1), ("p", 10, 10)],
        [("d1", 4, 1), ("d2", 5, 1), ("p", 20, 5), ("q", 0, 5)],  # p's last chunk, then q in the rest of M
        [("d1", 5, 1), ("d2", 6, 1), ("p", 25, 1), ("q", 5, 2)],  # p decodes now
    ]
    for out in outs:
        assert out.shape.num_decodes >= 2 and out.shape.num_prefill_tokens <= 10 < 64
    assert policy.observed[-4:] == [ExecutedBatch(o.shape, 0.01) for o in outs]
    run_all(sched)


class WholeRemainingPolicy(Base):
    """dLLM-style cost: a request takes its whole remaining sequence in one step, or waits
    (never chunked); requests that do not fit are skipped for smaller ones."""

    def next_batch(self, step: StepBuilder, now: float) -> None:
        for r in [*step.running, *step.waiting]:
            if r in step.waiting and not step.seqs_left:
                break
            if r.num_remaining_tokens <= step.tokens_left:
                step.add(r.key, r.num_remaining_tokens)


def test_a_request_can_cost_its_whole_remaining_sequence_and_is_never_chunked():
    sched, _ = make(WholeRemainingPolicy(), budget=16)
    add(sched, "a", 10, max_tokens=2)
    add(sched, "b", 10, max_tokens=2)
    add(sched, "c", 5, max_tokens=2)
    add(sched, "huge", 17, max_tokens=1)  # more than a step: never runs under this policy
    plans = []
    while len(sched.waiting) + len(sched.running) > 1:
        out = sched.schedule()
        assert out.entries and all(e.samples for e in out.entries)  # each took all it had left
        plans.append(plan(out))
        sched.update_from_output(out, {e.seq.key: 1 for e in out.entries}, 0.01)
    assert plans == [
        [("a", 0, 10), ("c", 0, 5)],  # b does not fit whole: c goes past it
        [("a", 10, 1), ("c", 5, 1), ("b", 0, 10)],
        [("b", 10, 1)],
    ]
    assert [s.request_id for s in sched.waiting] == ["huge"]
    assert sched.schedule().entries == []
    assert sched.abort(k("huge"))
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# ---- preempt --------------------------------------------------------------------------


class PriorityPolicy(Base):
    """Higher priority first; a waiting request that outranks a running one the memory
    cannot take next to it preempts the lowest-priority running request."""

    def next_batch(self, step: StepBuilder, now: float) -> None:
        waiting = sorted(step.waiting, key=lambda r: -r.priority)
        running = sorted(step.running, key=lambda r: -r.priority)
        if waiting and running and waiting[0].priority > running[-1].priority and step.seqs_left == 0:
            step.preempt(running[-1].key)
            running = running[:-1]
        for r in running:
            if step.tokens_left:
                step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))
        for r in waiting:
            if step.tokens_left and step.seqs_left:
                if not step.add(r.key, min(r.num_remaining_tokens, step.tokens_left)):
                    break


def test_a_policy_can_preempt_for_a_more_urgent_request():
    sched, _ = make(PriorityPolicy(), max_num_seqs=2)
    low = add(sched, "low", 4, max_tokens=6)
    mid = add(sched, "mid", 4, max_tokens=6, priority=1)
    step(sched)
    urgent = add(sched, "urgent", 4, max_tokens=2, priority=5)
    out = step(sched)
    assert out.preempted == [low] and plan(out) == [("mid", 4, 1)]  # nothing admitted in a preempting step
    assert low.status is SequenceStatus.WAITING and low.block_table == [] and low.num_preemptions == 1
    assert list(sched.waiting) == [low, urgent]
    assert plan(step(sched)) == [("mid", 5, 1), ("urgent", 0, 4)]  # the policy's order, not the queue's
    run_all(sched)
    assert low.num_output_tokens == 6 and mid.num_output_tokens == 6


# ---- FCFS blocks behind a waiting head; a skipping policy does not --------------------


class SkippingPolicy(Base):
    def next_batch(self, step: StepBuilder, now: float) -> None:
        add_running(step)
        for r in step.waiting:
            if step.tokens_left and step.seqs_left:
                step.add(r.key, min(r.num_remaining_tokens, step.tokens_left))  # 0: skip it, try the next


@pytest.mark.parametrize("policy,admitted", [(FcfsPolicy(), []), (SkippingPolicy(), ["small"])])
def test_skipping_a_blocked_waiting_request_lets_a_smaller_one_in_but_fcfs_does_not(policy, admitted):
    sched, _ = make(policy, num_blocks=4, block_size=4, caching=False)
    add(sched, "running", 8, max_tokens=4)  # 2 blocks, a 3rd for its decodes
    step(sched)
    big = add(sched, "big", 8, max_tokens=1)  # 2 blocks, 1 free once running grows
    add(sched, "small", 1, max_tokens=1)  # fits the last block
    out = step(sched)
    assert plan(out) == [("running", 8, 1)] + [(rid, 0, 1) for rid in admitted]
    assert big.status is SequenceStatus.WAITING and big.block_table == []
    run_all(sched)
    assert big.num_output_tokens == 1


# ---- contract breaches ----------------------------------------------------------------


class Scripted(Base):
    def __init__(self, script):
        super().__init__()
        self.script = script

    def next_batch(self, step: StepBuilder, now: float) -> None:
        self.script(step)


def _setup(script, max_num_seqs=8):
    """'run' is running (prefill done, decoding), 'kept' finished holding its KV, 'w1'..'w3' wait."""
    sched, _ = make(FcfsPolicy(), budget=16, max_num_seqs=max_num_seqs)
    add(sched, "run", 4, max_tokens=8)
    add(sched, "kept", 4, max_tokens=1, keep_kv=True)
    step(sched)
    assert sched.sequences[k("kept")].is_finished
    for rid, n in (("w1", 6), ("w2", 6), ("w3", 6)):
        add(sched, rid, n)
    sched.policy = Scripted(script)
    return sched


@pytest.mark.parametrize("script,message", [
    (lambda s: s.add(k("ghost"), 1), "stage ghost/0 is not in this step's queues"),
    (lambda s: s.add(StageKey("w1", 1), 1), "stage w1/1 is not in this step's queues"),  # another stage index
    (lambda s: s.add(k("kept"), 1), "stage kept/0 is not in this step's queues"),  # finished
    (lambda s: (s.add(k("w1"), 2), s.add(k("w1"), 2)), "stage w1/0 is already in this step"),
    (lambda s: (s.add(k("run"), 1), s.add(k("run"), 1)), "stage run/0 is already in this step"),
    (lambda s: s.add(k("w1"), 0), r"num_tokens must be in \[1, 6\], got 0"),
    (lambda s: s.add(k("w1"), -2), r"num_tokens must be in \[1, 6\], got -2"),
    (lambda s: s.add(k("w1"), 7), r"num_tokens must be in \[1, 6\], got 7"),
    (lambda s: s.add(k("run"), 2), r"num_tokens must be in \[1, 1\], got 2"),  # a decode has one token
    (lambda s: (s.add(k("w1"), 6), s.add(k("w2"), 6), s.add(k("w3"), 5)), "5 tokens exceed the 4 left"),
    (lambda s: s.preempt(k("w1")), "only a running stage not in this step can be preempted"),
    (lambda s: s.preempt(k("ghost")), "only a running stage not in this step can be preempted"),
    (lambda s: s.preempt(k("kept")), "only a running stage not in this step can be preempted"),
    (lambda s: (s.add(k("run"), 1), s.preempt(k("run"))), "only a running stage not in this step"),
    (lambda s: (s.preempt(k("run")), s.preempt(k("run"))), "only a running stage not in this step"),
])
def test_each_contract_breach_raises(script, message):
    sched = _setup(script)
    with pytest.raises(PolicyContractError, match=message):
        sched.schedule()


def test_admitting_past_max_num_seqs_raises():
    # max_num_seqs 3: 'run' is running, so two of the waiting may be admitted, not three.
    sched = _setup(lambda s: [s.add(k(r), 1) for r in ("w1", "w2", "w3")], max_num_seqs=3)
    with pytest.raises(PolicyContractError, match=r"stage w3/0: admitting it exceeds max_num_seqs \(3\)"):
        sched.schedule()


def test_after_a_preemption_adds_return_zero_instead_of_admitting():
    got = {}

    def script(s):
        s.preempt(k("run"))
        got["run"] = s.add(k("run"), 1)  # no longer running: nothing to add
        got["w1"] = s.add(k("w1"), 2)  # memory is short this step: nothing is admitted
        got["preempted_any"] = s.preempted_any

    sched = _setup(script)
    out = sched.schedule()
    assert got == {"run": 0, "w1": 0, "preempted_any": True}
    assert out.entries == [] and [q.request_id for q in out.preempted] == ["run"]
    assert [q.request_id for q in sched.waiting] == ["run", "w1", "w2", "w3"]  # the victim heads the queue
    assert sched.sequences[k("run")].block_table == []


def test_the_builder_reports_what_is_left_as_the_step_grows():
    log = []

    def script(s):
        log.append((s.tokens_left, s.seqs_left, s.preempted_any, s.budget.max_num_batched_tokens))
        assert s.add(k("w1"), 4) == 4
        log.append((s.tokens_left, s.seqs_left, s.preempted_any))
        assert s.add(k("run"), 1) == 1
        log.append((s.tokens_left, s.seqs_left, s.preempted_any))

    sched = _setup(script)
    out = sched.schedule()
    assert log == [(16, 7, False, 16), (12, 6, False), (11, 6, False)]
    assert plan(out) == [("w1", 0, 4), ("run", 4, 1)]  # in the order the policy added them


def test_views_are_snapshots_a_policy_cannot_write_through():
    def script(s):
        with pytest.raises(AttributeError):
            s.waiting[0].num_computed_tokens = 5

    sched = _setup(script)
    sched.schedule()
    assert sched.sequences[k("w1")].num_computed_tokens == 0


def test_a_policy_that_is_not_steady_is_never_fast_forwarded():
    sched, _ = make(SkippingPolicy())
    add(sched, "a", 3, max_tokens=10)
    step(sched)
    assert DecodeRun.find(sched, sched.schedule(), 1) is None  # SkippingPolicy declares no steady_decodes
    fcfs, _ = make(FcfsPolicy())
    add(fcfs, "a", 3, max_tokens=10)
    step(fcfs)
    assert DecodeRun.find(fcfs, fcfs.schedule(), 1).steps == 9
