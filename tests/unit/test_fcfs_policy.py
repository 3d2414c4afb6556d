"""FcfsPolicy.next_batch over hand-made queues (pure: no scheduler, no memory)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.policies import Batch, BatchEntry, FcfsPolicy, QueuedRequest, StepBudget, make_batch_policy
from workers.policies.base import ExecutedBatch


def req(rid, num_tokens, computed=0, prompt_len=None, arrival=0.0, priority=0) -> QueuedRequest:
    return QueuedRequest(
        request_id=rid,
        arrival_time=arrival,
        prompt_len=num_tokens if prompt_len is None else prompt_len,
        num_tokens=num_tokens,
        num_computed_tokens=computed,
        priority=priority,
    )


def decode(rid, ctx, prompt_len=None) -> QueuedRequest:
    """A running request with ctx tokens of KV and one new token to feed."""
    return req(rid, ctx + 1, ctx, prompt_len=ctx if prompt_len is None else prompt_len)


def pairs(batch: Batch) -> list[tuple[str, int]]:
    return [(e.request_id, e.num_tokens) for e in batch.entries]


POLICY = FcfsPolicy()


def test_name_and_registry():
    assert POLICY.name == "fcfs"
    assert isinstance(make_batch_policy("fcfs"), FcfsPolicy)
    with pytest.raises(ValueError, match="unknown batch policy"):
        make_batch_policy("nope")


def test_empty_queues_give_an_empty_batch():
    batch = POLICY.next_batch([], [], StepBudget(16, 4), 0.0)
    assert batch.entries == [] and batch.num_tokens == 0


def test_decodes_take_one_token_each_in_running_order():
    running = [decode("a", 10), decode("b", 3), decode("c", 7)]
    batch = POLICY.next_batch(running, [], StepBudget(100, 8), 0.0)
    assert pairs(batch) == [("a", 1), ("b", 1), ("c", 1)]
    assert batch.num_tokens == 3


def test_running_first_then_waiting_in_queue_order():
    running = [decode("r1", 5), req("r2", 30, 10)]  # r2 mid-prefill: 20 left
    waiting = [req("w1", 8), req("w2", 4)]
    batch = POLICY.next_batch(running, waiting, StepBudget(100, 8), 0.0)
    assert pairs(batch) == [("r1", 1), ("r2", 20), ("w1", 8), ("w2", 4)]


def test_queue_order_wins_over_arrival_time_and_priority():
    # preempted requests are put at the head of the queue; FCFS follows the queue
    waiting = [req("late", 3, arrival=9.0, priority=-5), req("early", 3, arrival=1.0, priority=5)]
    batch = POLICY.next_batch([], waiting, StepBudget(100, 8), 10.0)
    assert pairs(batch) == [("late", 3), ("early", 3)]


def test_chunked_prefill_of_the_waiting_tail():
    waiting = [req("a", 6), req("b", 50), req("c", 5)]
    batch = POLICY.next_batch([], waiting, StepBudget(16, 8), 0.0)
    assert pairs(batch) == [("a", 6), ("b", 10)]  # budget exhausted: c gets nothing
    assert batch.num_tokens == 16


def test_running_prefill_is_chunked_by_the_budget_and_starves_waiting():
    running = [req("big", 100, 0)]
    batch = POLICY.next_batch(running, [req("w", 1)], StepBudget(32, 8), 0.0)
    assert pairs(batch) == [("big", 32)]


def test_running_requests_beyond_the_budget_are_dropped():
    running = [req("a", 10, 0), decode("b", 4), decode("c", 4)]
    batch = POLICY.next_batch(running, [], StepBudget(11, 8), 0.0)
    assert pairs(batch) == [("a", 10), ("b", 1)]


def test_cached_prefix_shortens_a_waiting_request():
    waiting = [req("hit", 20, computed=16), req("cold", 20)]
    batch = POLICY.next_batch([], waiting, StepBudget(10, 8), 0.0)
    assert pairs(batch) == [("hit", 4), ("cold", 6)]


def test_max_num_seqs_counts_running_requests():
    running = [decode("r1", 3), decode("r2", 3)]
    waiting = [req("w1", 2), req("w2", 2), req("w3", 2)]
    batch = POLICY.next_batch(running, waiting, StepBudget(100, 3), 0.0)
    assert pairs(batch) == [("r1", 1), ("r2", 1), ("w1", 2)]
    full = POLICY.next_batch(running, waiting, StepBudget(100, 2), 0.0)
    assert pairs(full) == [("r1", 1), ("r2", 1)]


def test_max_num_seqs_caps_waiting_only_batch():
    waiting = [req(f"w{i}", 1) for i in range(10)]
    batch = POLICY.next_batch([], waiting, StepBudget(100, 4), 0.0)
    assert [e.request_id for e in batch.entries] == ["w0", "w1", "w2", "w3"]


def test_budget_of_one_token():
    running = [decode("a", 5), decode("b", 5)]
    batch = POLICY.next_batch(running, [req("w", 4)], StepBudget(1, 8), 0.0)
    assert pairs(batch) == [("a", 1)]
    batch = POLICY.next_batch([], [req("w", 4), req("x", 1)], StepBudget(1, 8), 0.0)
    assert pairs(batch) == [("w", 1)]


def test_now_does_not_change_the_choice_and_observe_is_a_noop():
    running = [decode("a", 5), req("b", 9, 2)]
    waiting = [req("w", 7)]
    first = POLICY.next_batch(running, waiting, StepBudget(12, 4), 0.0)
    POLICY.observe(ExecutedBatch(10, 2, 100, 0.5))
    second = POLICY.next_batch(running, waiting, StepBudget(12, 4), 1e9)
    assert first == second
    assert pairs(first) == [("a", 1), ("b", 7), ("w", 4)]


def test_inputs_are_not_mutated():
    running = [decode("a", 5)]
    waiting = [req("w", 7)]
    POLICY.next_batch(running, waiting, StepBudget(4, 4), 0.0)
    assert running == [decode("a", 5)] and waiting == [req("w", 7)]


def test_queued_request_properties():
    d = decode("a", 10)
    assert d.num_remaining_tokens == 1 and d.is_decode
    p = req("p", 10, 3)
    assert p.num_remaining_tokens == 7 and not p.is_decode
    # last prompt token left (e.g. fully cached prefix): one token but still prefill
    last = req("l", 10, 9, prompt_len=10)
    assert last.num_remaining_tokens == 1 and not last.is_decode
    assert Batch([BatchEntry("x", 3), BatchEntry("y", 4)]).num_tokens == 7


# ---- property: structural guarantees ----------------------------------------------


@st.composite
def queues(draw):
    def one(prefix, i, running):
        n = draw(st.integers(1, 300))
        c = draw(st.integers(0, n - 1))
        return req(f"{prefix}{i}", n, c)

    running = [one("r", i, True) for i in range(draw(st.integers(0, 10)))]
    waiting = [one("w", i, False) for i in range(draw(st.integers(0, 10)))]
    budget = StepBudget(draw(st.integers(1, 512)), draw(st.integers(max(1, len(running)), 16)))
    return running, waiting, budget


@settings(max_examples=300, deadline=None)
@given(queues())
def test_fcfs_structural_properties(q):
    running, waiting, budget = q
    batch = POLICY.next_batch(running, waiting, budget, 0.0)
    got = pairs(batch)
    ids = [r for r, _ in got]
    assert len(ids) == len(set(ids))
    assert batch.num_tokens <= budget.max_num_batched_tokens
    assert all(n >= 1 for _, n in got)
    by_id = {r.request_id: r for r in running + waiting}
    assert all(n <= by_id[r].num_remaining_tokens for r, n in got)
    # order: a prefix of running (in order) followed by a prefix of waiting (in order)
    order = [r.request_id for r in running] + [r.request_id for r in waiting]
    n_run = sum(1 for r in ids if r.startswith("r"))
    assert ids[:n_run] == [r.request_id for r in running[:n_run]]
    assert ids[n_run:] == [r.request_id for r in waiting[: len(ids) - n_run]]
    assert [i for i in order if i in set(ids)] == ids
    # running plus admitted waiting requests respect max_num_seqs
    assert len(running) + (len(ids) - n_run) <= max(budget.max_num_seqs, len(running))
    # work conservation: every scheduled request but the last gets all it asked for,
    # and tokens are left over only when there is nothing more to schedule
    for r, n in got[:-1]:
        assert n == by_id[r].num_remaining_tokens
    if batch.num_tokens < budget.max_num_batched_tokens:
        assert n_run == len(running)
        admitted = len(ids) - n_run
        assert admitted == len(waiting) or len(running) + admitted >= budget.max_num_seqs
