"""The priority scheduling policy (vLLM's `--scheduling-policy priority`) on the real core
`Scheduler` (no fakes): a lower `priority` value first, ties by arrival; the preemption victim
is the running request with the largest (priority, arrival), the growing request itself when
that is it; fcfs keeps arrival order whatever the priorities."""

from __future__ import annotations

import pytest

from splitserve.core import (BlockManager, FcfsPolicy, SamplingParams, Scheduler, SchedulerConfig, SequenceStatus,
                             StageSlo, StageSpec, make_batch_policy)
from splitserve.core.policy import QueuedRequest, priority_key, scheduling_policy_option


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy, *, num_blocks=64, block_size=4, budget=64, max_num_seqs=8):
    clock = Clock()
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len=1 << 20, vocab_size=4096),
                      BlockManager(num_blocks, block_size, False), policy, clock)
    return sched, clock


_tokens = iter(range(100, 10**6))


def add(sched, clock, rid, prompt_len, *, at, priority=0, max_tokens=4, ttft_s=None):
    clock.now = at
    prompt = [next(_tokens) % 4000 for _ in range(prompt_len)]
    return sched.add_stage(StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority,
                                           slo=StageSlo(ttft_s=ttft_s)))


def step(sched):
    out = sched.schedule()
    sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, 0.01)
    return out


def admitted(out) -> list[str]:
    return [e.seq.request_id for e in out.entries]


def priority(name="fcfs", **options):
    return make_batch_policy(name, scheduling_policy="priority", **options)


# ---- the key and the option -----------------------------------------------------------------

def test_the_key_is_priority_then_arrival_lower_first():
    reqs = [QueuedRequest(key=None, arrival_time=t, prompt_len=1, num_tokens=1, num_computed_tokens=0, priority=p)
            for p, t in ((1, 0.0), (0, 5.0), (0, 2.0), (-3, 9.0))]
    assert [(r.priority, r.arrival_time) for r in sorted(reqs, key=priority_key)] == [(-3, 9.0), (0, 2.0), (0, 5.0),
                                                                                     (1, 0.0)]


def test_the_option_names_itself_and_its_choices():
    assert scheduling_policy_option("priority") == "priority" and scheduling_policy_option(None) == "fcfs"
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of fcfs \| priority, got 'lifo'"):
        make_batch_policy("fcfs", scheduling_policy="lifo")


@pytest.mark.parametrize("name", ["fcfs", "slo_aware", "prefill_reorder", "laps", "prefill_first"])
def test_every_registered_policy_takes_it(name):
    assert make_batch_policy(name, scheduling_policy="priority").scheduling_policy == "priority"
    assert getattr(make_batch_policy(name), "scheduling_policy", "fcfs") == "fcfs"


# ---- waiting order ------------------------------------------------------------------------------

def test_waiting_requests_go_by_priority_then_arrival():
    sched, clock = make(priority(), budget=8)  # one 8-token prompt per step
    for rid, at, prio in (("a", 0.0, 0), ("b", 1.0, 5), ("c", 2.0, -1), ("d", 3.0, 0)):
        add(sched, clock, rid, 8, at=at, priority=prio, max_tokens=1)
    order = []
    while sched.has_unfinished():
        order += admitted(step(sched))
    assert order == ["c", "a", "d", "b"]  # -1, then the two 0s by arrival, then 5


def test_fcfs_keeps_arrival_order_whatever_the_priorities():
    sched, clock = make(FcfsPolicy(), budget=8)
    for rid, at, prio in (("a", 0.0, 0), ("b", 1.0, 5), ("c", 2.0, -1)):
        add(sched, clock, rid, 8, at=at, priority=prio, max_tokens=1)
    order = []
    while sched.has_unfinished():
        order += admitted(step(sched))
    assert order == ["a", "b", "c"]


def test_ties_in_priority_and_arrival_keep_queue_order():
    sched, clock = make(priority(), budget=8)
    for rid in ("x", "y", "z"):
        add(sched, clock, rid, 8, at=1.0, priority=2, max_tokens=1)
    order = []
    while sched.has_unfinished():
        order += admitted(step(sched))
    assert order == ["x", "y", "z"]


def test_the_best_request_is_seen_even_behind_more_than_max_num_seqs():
    sched, clock = make(priority(), budget=4, max_num_seqs=2)
    for i in range(5):
        add(sched, clock, f"low{i}", 4, at=float(i), priority=9, max_tokens=1)
    add(sched, clock, "urgent", 4, at=10.0, priority=0, max_tokens=1)
    assert admitted(step(sched)) == ["urgent"]


# ---- preemption ---------------------------------------------------------------------------------

def _three_running(policy):
    """A (priority 0) and B (priority 5) admitted together, C (priority 1) a step later; the
    6 blocks are then full, and A's next token needs a seventh."""
    sched, clock = make(policy, num_blocks=6, block_size=4, budget=64)
    a = add(sched, clock, "A", 7, at=0.0, priority=0, max_tokens=8)
    b = add(sched, clock, "B", 7, at=1.0, priority=5, max_tokens=8)
    assert admitted(step(sched)) == ["A", "B"]
    c = add(sched, clock, "C", 7, at=2.0, priority=1, max_tokens=8)
    assert admitted(step(sched)) == ["A", "B", "C"]
    assert sched.block_manager.num_free_blocks == 0
    return sched, a, b, c


def test_the_lowest_priority_running_request_is_preempted_not_the_newest():
    sched, a, b, c = _three_running(priority())
    out = step(sched)
    assert out.preempted == [b] and admitted(out) == ["A", "C"]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1


def test_fcfs_preempts_the_newest_whatever_the_priorities():
    sched, a, b, c = _three_running(FcfsPolicy())
    out = step(sched)
    assert out.preempted == [c] and admitted(out) == ["A", "B"]


def _low_then_high(policy):
    """A low-priority request running first, a high-priority one admitted after it; the 4 blocks
    are full and each needs one more for its next token."""
    sched, clock = make(policy, num_blocks=4, block_size=4, budget=64)
    low = add(sched, clock, "low", 7, at=0.0, priority=7, max_tokens=8)
    assert admitted(step(sched)) == ["low"]
    high = add(sched, clock, "high", 8, at=1.0, priority=0, max_tokens=8)
    assert admitted(step(sched)) == ["low", "high"]
    assert sched.block_manager.num_free_blocks == 0
    return sched, low, high


def test_a_growing_request_that_is_the_lowest_priority_preempts_itself():
    sched, low, high = _low_then_high(priority())
    out = step(sched)  # low grows first (running order), and everyone it could displace outranks it
    assert out.preempted == [low] and admitted(out) == ["high"]
    assert low.status is SequenceStatus.WAITING and high.status is SequenceStatus.RUNNING


def test_fcfs_displaces_the_newest_to_let_the_oldest_grow():
    sched, low, high = _low_then_high(FcfsPolicy())
    out = step(sched)
    assert out.preempted == [high] and admitted(out) == ["low"]


def test_ties_preempt_the_later_arrival():
    sched, clock = make(priority(), num_blocks=4, block_size=4, budget=64)
    first = add(sched, clock, "first", 8, at=0.0, priority=2, max_tokens=8)
    second = add(sched, clock, "second", 8, at=1.0, priority=2, max_tokens=8)
    assert admitted(step(sched)) == ["first", "second"]
    out = step(sched)
    assert out.preempted == [second] and admitted(out) == ["first"]


def test_a_preempted_request_comes_back_in_priority_order():
    sched, clock = make(priority(), num_blocks=4, block_size=4, budget=64)
    low = add(sched, clock, "low", 8, at=0.0, priority=3, max_tokens=8)
    high = add(sched, clock, "high", 8, at=1.0, priority=1, max_tokens=8)
    assert admitted(step(sched)) == ["high", "low"]
    assert step(sched).preempted == [low]
    add(sched, clock, "later_low", 8, at=2.0, priority=3, max_tokens=1)
    add(sched, clock, "later_high", 8, at=3.0, priority=2, max_tokens=1)
    first_admitted: dict[str, int] = {}
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 200, "no progress"
        for rid in admitted(step(sched)):
            first_admitted.setdefault(rid, steps)
    assert first_admitted["later_high"] <= first_admitted["low"] <= first_admitted["later_low"]
    assert (high.num_output_tokens, low.num_output_tokens) == (8, 8)


# ---- AMPD's reordering window respects priorities ------------------------------------------------

@pytest.mark.parametrize("long_priority, short_priority, first_step", [
    (0, 0, ["short", "long"]),  # one class: the urgent short prefill overtakes (AMPD Alg. 2)
    (0, 1, ["long"]),  # the short one is of a worse priority: it never overtakes
    (1, 0, ["short", "long"]),  # the better priority is first anyway
])
def test_prefill_reordering_overtakes_only_within_a_priority(long_priority, short_priority, first_step):
    from splitserve.perf.presets import preset

    policy = priority("prefill_reorder", perf_model=preset("A100", "Qwen2.5-14B"))
    sched, clock = make(policy, num_blocks=20_000, block_size=16, budget=2048)
    add(sched, clock, "long", 6000, at=0.0, priority=long_priority, ttft_s=5.0)
    add(sched, clock, "short", 500, at=0.0, priority=short_priority, ttft_s=1.0)
    assert admitted(step(sched)) == first_step


# ---- the gateway's refusal (vLLM: "Got priority 3 but Priority scheduling is not enabled") -------

def test_the_gateway_refuses_a_priority_the_cluster_does_not_schedule_by():
    from gateway.priority_check import check_priority
    from splitserve.errors import InvalidArgument

    for value in (0, 3, -2):
        check_priority(value, "priority")
    check_priority(0, "fcfs")
    with pytest.raises(InvalidArgument, match="priority must be 0: this cluster schedules fcfs") as refused:
        check_priority(3, "fcfs")
    assert (refused.value.param, refused.value.http_status, refused.value.status) == ("priority", 400,
                                                                                     "INVALID_ARGUMENT")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        check_priority(0, "lifo")
