"""AMPD's prefill reordering (Alg. 2) on the real core `Scheduler` (no fakes), plus the window
search as plain data against brute force."""

from __future__ import annotations

import itertools

import pytest
from conftest import add_request, policy_scheduler, run_step
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core import FcfsPolicy, StageKey, build_batch_policy, known_batch_policies, step_time
from splitserve.core.policies import PrefillReorderPolicy
from splitserve.core.policies.prefill_reorder import best_ordering
from splitserve.perf.presets import preset

MODEL = preset("A100", "Qwen2.5-14B")


def make(policy, *, budget=4096, max_num_seqs=256, num_blocks=20_000):
    return policy_scheduler(policy, budget=budget, max_num_seqs=max_num_seqs, num_blocks=num_blocks)


def add(sched, rid, prompt_len, ttft_s=None, max_tokens=4):
    add_request(sched, rid, prompt_len, ttft_s, max_tokens)


def step(sched):
    return run_step(sched, MODEL)


def admitted(out):
    return [e.seq.request_id for e in out.entries if e.start == 0]


def first_token_times(sched, names, max_steps=10_000):
    """Run to the end; when each request's prefill finished (its first token)."""
    done: dict[str, float] = {}
    for _ in range(max_steps):
        if not sched.waiting and not sched.running:
            return done
        out = step(sched)
        for e in out.entries:
            rid = e.seq.request_id
            if rid in names and rid not in done and e.start + e.num_new_tokens >= e.seq.prompt_len:
                done[rid] = sched.clock.now
    raise AssertionError("did not finish")


# ---- the window search -------------------------------------------------------------------------


def test_queue_order_wins_ties():
    order, met = best_ordering([10.0, 10.0, 10.0], [1.0, 1.0, 1.0], [False] * 3, now=0.0)
    assert order == (0, 1, 2) and met == 3
    order, met = best_ordering([None, None], [5.0, 1.0], [False, False], now=0.0)
    assert order == (0, 1) and met == 2


def test_a_short_urgent_task_overtakes_a_long_relaxed_one():
    # Queue order: long (deadline 10 s, takes 4 s), short (deadline 1.5 s, takes 1 s).
    order, met = best_ordering([10.0, 1.5], [4.0, 1.0], [False, False], now=0.0)
    assert order == (1, 0) and met == 2
    # With the long one capped it keeps its place: only one can be met.
    order, met = best_ordering([10.0, 1.5], [4.0, 1.0], [True, False], now=0.0)
    assert order == (0, 1) and met == 1
    # The offset of running prefill work counts: with 9 s ahead, only the short one can make it.
    order, met = best_ordering([10.0, 9.6], [4.0, 0.5], [False, False], now=0.0, offset=9.0)
    assert order == (1, 0) and met == 1


def _valid(order, capped):
    return not any(capped[t] and any(e > t for e in order[:p]) for p, t in enumerate(order))


def _met(order, deadlines, durations, now, offset):
    finish, met = now + offset, 0
    for t in order:
        finish += durations[t]
        met += deadlines[t] is None or finish <= deadlines[t]
    return met


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 20)), st.floats(0, 5), st.booleans()),
                min_size=1, max_size=5),
       st.floats(0, 5))
def test_the_search_finds_the_best_valid_ordering_and_prefers_queue_order(tasks, offset):
    deadlines = [t[0] for t in tasks]
    durations = [t[1] for t in tasks]
    capped = [t[2] for t in tasks]
    order, met = best_ordering(deadlines, durations, capped, now=0.0, offset=offset)
    assert sorted(order) == list(range(len(tasks))) and _valid(order, capped)
    valid = [o for o in itertools.permutations(range(len(tasks))) if _valid(o, capped)]
    best = max(_met(o, deadlines, durations, 0.0, offset) for o in valid)
    assert met == best == _met(order, deadlines, durations, 0.0, offset)
    # The first best ordering in lexicographic order: the queue order whenever it is best.
    assert order == next(o for o in valid if _met(o, deadlines, durations, 0.0, offset) == best)


# ---- on the scheduler --------------------------------------------------------------------------


def test_registered_and_built_with_the_drivers_model():
    assert "prefill_reorder" in known_batch_policies()
    policy = build_batch_policy("prefill_reorder", {"window": "4", "ttft_slo_ms": "500"}, perf_model=MODEL)
    assert isinstance(policy, PrefillReorderPolicy) and policy.perf_model is MODEL
    assert policy.window == 4 and policy.default_ttft_slo_s == 0.5
    for bad, field in (({"window": "0"}, "window"), ({"window": "x"}, "window"), ({"ttft_slo_ms": "-1"}, "ttft_slo_ms")):
        with pytest.raises(ValueError, match=field):
            build_batch_policy("prefill_reorder", bad)


def test_an_urgent_short_prefill_overtakes_a_long_one_and_both_meet_their_deadlines():
    results = {}
    for policy in (FcfsPolicy(), PrefillReorderPolicy(MODEL)):
        sched = make(policy, budget=2048)
        add(sched, "long", 6000, ttft_s=5.0)
        add(sched, "short", 500, ttft_s=1.0)
        first = step(sched)
        results[policy.name] = (admitted(first), first_token_times(sched, {"long", "short"}))
    assert results["fcfs"][0] == ["long"]
    assert results["prefill_reorder"][0] == ["short", "long"]  # short first, long takes the rest of the budget
    fcfs_times, reorder_times = results["fcfs"][1], results["prefill_reorder"][1]
    assert fcfs_times["short"] > 1.0 >= reorder_times["short"]
    assert reorder_times["long"] <= 5.0


def test_without_objectives_it_schedules_exactly_as_fcfs():
    plans = []
    for policy in (FcfsPolicy(), PrefillReorderPolicy(MODEL)):
        sched = make(policy, budget=1024, num_blocks=400)
        for i, n in enumerate([900, 40, 3000, 12, 700, 1500, 64, 300]):
            add(sched, f"r{i}", n, max_tokens=8)
        plan = []
        while sched.waiting or sched.running:
            out = step(sched)
            plan.append([(e.seq.request_id, e.start, e.num_new_tokens) for e in out.entries])
        plans.append(plan)
    assert plans[0] == plans[1]


def test_a_task_is_overtaken_at_most_window_times():
    policy = PrefillReorderPolicy(MODEL, window=2)
    sched = make(policy, budget=1024)
    add(sched, "long", 20_000, ttft_s=600.0)
    overtakes = 0
    for i in range(10):  # a stream of urgent prefills, one per step, each taking a whole step
        add(sched, f"s{i}", 1024, ttft_s=2.0, max_tokens=1)
        out = step(sched)
        names = admitted(out)
        if "long" in names:
            break
        overtakes += 1
        assert policy.postponements[StageKey("long", 0)] == overtakes
    assert overtakes == 2  # the cap (window = 2), then long runs and keeps running
    assert "long" in [e.seq.request_id for e in step(sched).entries]


def test_without_a_model_it_learns_the_prefill_rate_from_executed_steps():
    policy = PrefillReorderPolicy(window=3, learning_rate=1.0)
    sched = make(policy, budget=2048)
    assert policy.seconds_per_prefill_token == 0.0
    add(sched, "warm", 1000)
    out = step(sched)
    rate = policy.seconds_per_prefill_token
    assert rate == pytest.approx(step_time(MODEL, out.shape) / 1000) and rate > 0
    step(sched)  # a decode-only step says nothing about prefill: the rate stays
    assert policy.seconds_per_prefill_token == rate
    add(sched, "long", 6000, ttft_s=60.0)
    add(sched, "short", 300, ttft_s=0.2)
    assert admitted(step(sched))[0] == "short"
