"""FcfsPolicy.next_batch over hand-made queues (pure: no scheduler, no memory).

The policy builds a step through a `StepBuilder`; here that is `FakeStep`, which grants
what is asked unless told that a request finds no KV memory, and enforces the builder's
contract exactly as the core's does (`PolicyContractError`), so that every test also
checks that FCFS never breaks it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core import (ExecutedBatch, FcfsPolicy, PolicyContractError, QueuedRequest, StageKey, StepBudget,
                             StepShape, known_batch_policies, make_batch_policy)


def req(rid, num_tokens, computed=0, prompt_len=None, arrival=0.0, priority=0) -> QueuedRequest:
    return QueuedRequest(
        key=StageKey(rid, 0),
        arrival_time=arrival,
        prompt_len=num_tokens if prompt_len is None else prompt_len,
        num_tokens=num_tokens,
        num_computed_tokens=computed,
        priority=priority,
    )


def decode(rid, ctx, prompt_len=None) -> QueuedRequest:
    """A running request with ctx tokens of KV and one new token to feed."""
    return req(rid, ctx + 1, ctx, prompt_len=ctx if prompt_len is None else prompt_len)


class FakeStep:
    """A StepBuilder over plain queues. `no_memory`: request ids whose `add` gets 0 (a running
    one is then preempted, as the core preempts a request that cannot grow)."""

    def __init__(self, running, waiting, budget: StepBudget, no_memory=()):
        self.running, self.waiting, self.budget = list(running), list(waiting), budget
        self._views = {r.key: r for r in [*running, *waiting]}
        self._running_keys = {r.key for r in running}
        self._no_memory = {StageKey(rid, 0) for rid in no_memory}
        self._num_running = len(running)
        self._tokens_left = budget.max_num_batched_tokens
        self.calls: list[tuple[str, int, int]] = []  # (request id, asked, granted), in call order
        self.preempted: list[StageKey] = []
        self.held_until = None

    @property
    def tokens_left(self) -> int:
        return self._tokens_left

    @property
    def seqs_left(self) -> int:
        return self.budget.max_num_seqs - self._num_running

    @property
    def preempted_any(self) -> bool:
        return bool(self.preempted)

    def add(self, key: StageKey, num_tokens: int) -> int:
        view = self._views.get(key)
        if view is None:
            raise PolicyContractError(f"unknown {key}")
        if any(k == key.request_id and granted for k, _, granted in self.calls):
            raise PolicyContractError(f"{key} twice")
        if not 1 <= num_tokens <= min(view.num_remaining_tokens, self._tokens_left):
            raise PolicyContractError(f"{key}: {num_tokens} tokens")
        granted = num_tokens
        if key in self._running_keys:
            if key in self.preempted:
                granted = 0
            elif key in self._no_memory:
                self.preempted.append(key)
                self._num_running -= 1
                granted = 0
        else:
            if self.seqs_left <= 0:
                raise PolicyContractError(f"{key}: max_num_seqs")
            if self.preempted or key in self._no_memory:
                granted = 0
            else:
                self._num_running += 1
        self.calls.append((key.request_id, num_tokens, granted))
        self._tokens_left -= granted
        return granted

    def preempt(self, key: StageKey) -> None:
        raise AssertionError("FCFS never preempts on its own")

    def hold_until(self, t: float) -> None:
        raise AssertionError("FCFS never holds work back")


POLICY = FcfsPolicy()


def next_batch(running, waiting, budget, now=0.0, no_memory=()) -> FakeStep:
    step = FakeStep(running, waiting, budget, no_memory)
    assert POLICY.next_batch(step, now) is None
    return step


def pairs(step: FakeStep) -> list[tuple[str, int]]:
    """What the step runs: (request id, tokens) of every granted add, in order."""
    return [(rid, granted) for rid, _, granted in step.calls if granted]


def test_name_registry_and_driver_flags():
    assert POLICY.name == "fcfs"
    assert "fcfs" in known_batch_policies()
    assert isinstance(make_batch_policy("fcfs"), FcfsPolicy)
    with pytest.raises(ValueError, match="unknown batch policy"):
        make_batch_policy("nope")
    with pytest.raises(ValueError, match="bad options for batch policy 'fcfs'"):
        make_batch_policy("fcfs", window=3)
    # observe() ignores its argument; with only decodes running and nothing admissible it
    # always schedules every running request with one token (drivers may fast-forward).
    assert FcfsPolicy.observes_steps is False and FcfsPolicy.steady_decodes is True


def test_empty_queues_give_an_empty_step():
    step = next_batch([], [], StepBudget(16, 4))
    assert step.calls == [] and step.tokens_left == 16


def test_decodes_take_one_token_each_in_running_order():
    running = [decode("a", 10), decode("b", 3), decode("c", 7)]
    step = next_batch(running, [], StepBudget(100, 8))
    assert pairs(step) == [("a", 1), ("b", 1), ("c", 1)]
    assert step.tokens_left == 97


def test_running_first_then_waiting_in_queue_order():
    running = [decode("r1", 5), req("r2", 30, 10)]  # r2 mid-prefill: 20 left
    waiting = [req("w1", 8), req("w2", 4)]
    step = next_batch(running, waiting, StepBudget(100, 8))
    assert pairs(step) == [("r1", 1), ("r2", 20), ("w1", 8), ("w2", 4)]


def test_queue_order_wins_over_arrival_time_and_priority():
    # preempted requests are put at the head of the queue; FCFS follows the queue
    waiting = [req("late", 3, arrival=9.0, priority=-5), req("early", 3, arrival=1.0, priority=5)]
    step = next_batch([], waiting, StepBudget(100, 8), 10.0)
    assert pairs(step) == [("late", 3), ("early", 3)]


def test_chunked_prefill_of_the_waiting_tail():
    waiting = [req("a", 6), req("b", 50), req("c", 5)]
    step = next_batch([], waiting, StepBudget(16, 8))
    assert pairs(step) == [("a", 6), ("b", 10)]  # budget exhausted: c gets nothing
    assert step.tokens_left == 0


def test_running_prefill_is_chunked_by_the_budget_and_starves_waiting():
    step = next_batch([req("big", 100, 0)], [req("w", 1)], StepBudget(32, 8))
    assert pairs(step) == [("big", 32)]


def test_running_requests_beyond_the_budget_are_dropped():
    running = [req("a", 10, 0), decode("b", 4), decode("c", 4)]
    step = next_batch(running, [], StepBudget(11, 8))
    assert pairs(step) == [("a", 10), ("b", 1)]


def test_cached_prefix_shortens_a_waiting_request():
    waiting = [req("hit", 20, computed=16), req("cold", 20)]
    step = next_batch([], waiting, StepBudget(10, 8))
    assert pairs(step) == [("hit", 4), ("cold", 6)]


def test_max_num_seqs_counts_running_requests():
    running = [decode("r1", 3), decode("r2", 3)]
    waiting = [req("w1", 2), req("w2", 2), req("w3", 2)]
    assert pairs(next_batch(running, waiting, StepBudget(100, 3))) == [("r1", 1), ("r2", 1), ("w1", 2)]
    assert pairs(next_batch(running, waiting, StepBudget(100, 2))) == [("r1", 1), ("r2", 1)]


def test_max_num_seqs_caps_waiting_only_batch():
    waiting = [req(f"w{i}", 1) for i in range(10)]
    step = next_batch([], waiting, StepBudget(100, 4))
    assert [rid for rid, _ in pairs(step)] == ["w0", "w1", "w2", "w3"]


def test_budget_of_one_token():
    running = [decode("a", 5), decode("b", 5)]
    assert pairs(next_batch(running, [req("w", 4)], StepBudget(1, 8))) == [("a", 1)]
    assert pairs(next_batch([], [req("w", 4), req("x", 1)], StepBudget(1, 8))) == [("w", 1)]


def test_a_waiting_head_without_memory_blocks_the_queue_behind_it():
    waiting = [req("w1", 4), req("big", 40), req("small", 1)]
    step = next_batch([decode("r", 3)], waiting, StepBudget(100, 8), no_memory=["big"])
    assert pairs(step) == [("r", 1), ("w1", 4)]
    assert step.calls[-1] == ("big", 40, 0)  # tried, got nothing, and nobody overtook it


def test_a_preempted_running_request_is_skipped_and_nothing_is_admitted():
    running = [decode("a", 3), decode("b", 3), decode("c", 3)]
    step = next_batch(running, [req("w", 2)], StepBudget(100, 8), no_memory=["b"])
    assert pairs(step) == [("a", 1), ("c", 1)]  # the others still run
    assert [rid for rid, _, _ in step.calls] == ["a", "b", "c"]  # w not even tried: memory is short


def test_now_does_not_change_the_choice_and_observe_is_a_noop():
    running = [decode("a", 5), req("b", 9, 2)]
    waiting = [req("w", 7)]
    first = next_batch(running, waiting, StepBudget(12, 4), 0.0)
    POLICY.observe(ExecutedBatch(StepShape(((0, 10),), 2, 100), 0.5))
    second = next_batch(running, waiting, StepBudget(12, 4), 1e9)
    assert first.calls == second.calls
    assert pairs(first) == [("a", 1), ("b", 7), ("w", 4)]


def test_inputs_are_not_mutated():
    running = [decode("a", 5)]
    waiting = [req("w", 7)]
    step = next_batch(running, waiting, StepBudget(4, 4))
    assert step.running == [decode("a", 5)] and step.waiting == [req("w", 7)]


def test_queued_request_properties():
    d = decode("a", 10)
    assert d.num_remaining_tokens == 1 and d.is_decode
    p = req("p", 10, 3)
    assert p.num_remaining_tokens == 7 and not p.is_decode
    # last prompt token left (e.g. fully cached prefix): one token but still prefill
    last = req("l", 10, 9, prompt_len=10)
    assert last.num_remaining_tokens == 1 and not last.is_decode
    with pytest.raises(AttributeError):
        d.num_computed_tokens = 3  # frozen: a policy cannot change what the scheduler shows it


# ---- property: structural guarantees ----------------------------------------------


@st.composite
def queues(draw):
    def one(prefix, i):
        n = draw(st.integers(1, 300))
        c = draw(st.integers(0, n - 1))
        return req(f"{prefix}{i}", n, c)

    running = [one("r", i) for i in range(draw(st.integers(0, 10)))]
    waiting = [one("w", i) for i in range(draw(st.integers(0, 10)))]
    budget = StepBudget(draw(st.integers(1, 512)), draw(st.integers(max(1, len(running)), 16)))
    names = [r.key.request_id for r in running + waiting]
    no_memory = draw(st.sets(st.sampled_from(names))) if names and draw(st.booleans()) else set()
    return running, waiting, budget, no_memory


@settings(max_examples=300, deadline=None, derandomize=True)
@given(queues())
def test_fcfs_structural_properties(q):
    running, waiting, budget, no_memory = q
    step = next_batch(running, waiting, budget, no_memory=no_memory)  # FakeStep raises on a contract breach
    got = pairs(step)
    tried = [rid for rid, _, _ in step.calls]
    assert len(tried) == len(set(tried))
    assert sum(n for _, n in got) <= budget.max_num_batched_tokens
    by_id = {r.key.request_id: r for r in running + waiting}
    assert all(1 <= n <= by_id[r].num_remaining_tokens for r, n in got)
    # order: a prefix of running (in order) followed by a prefix of waiting (in order)
    n_run = sum(1 for r in tried if r.startswith("r"))
    assert tried[:n_run] == [r.key.request_id for r in running[:n_run]]
    assert tried[n_run:] == [r.key.request_id for r in waiting[: len(tried) - n_run]]
    # FCFS: the first waiting request that gets nothing is the last one tried, and nothing
    # waiting is tried once a running request was preempted (memory is short)
    denied_waiting = [i for i, (rid, _, g) in enumerate(step.calls) if rid.startswith("w") and not g]
    assert denied_waiting in ([], [len(step.calls) - 1])
    if step.preempted_any:
        assert n_run == len(tried)
    admitted = sum(1 for rid, _ in got if rid.startswith("w"))
    assert len(running) - len(step.preempted) + admitted <= max(budget.max_num_seqs, len(running))
    # work conservation: every scheduled request but the last gets all it asked for, and
    # tokens are left over only when nothing more could be scheduled
    for rid, n in got[:-1]:
        assert n == by_id[rid].num_remaining_tokens
    if step.tokens_left > 0:
        assert n_run == len(running)
        assert (len(tried) - n_run == len(waiting) or step.seqs_left == 0 or step.preempted_any
                or denied_waiting != [])
