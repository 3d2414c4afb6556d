"""The prefill-first local batch policy: over hand-made queues (a `StepBuilder` fake that
enforces the contract), on the real core `Scheduler`, and in whole simulations
(fast-forwarded decode runs equal stepping; TTFT down and ITL up against fcfs)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_request, policy_scheduler, run_step
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen import arrivals
from loadgen.sessions import Round, Session
from services.planner.sim_workload import SimRequestSpec
from services.planner.simulator import NetworkLatency, Simulator
from splitserve.core import FcfsPolicy, PolicyContractError, QueuedRequest, StageKey, StepBudget
from splitserve.core.policies import PrefillFirstPolicy, build_batch_policy, known_batch_policies, make_batch_policy
from splitserve.perf.model import DecodeCoeffs, PerfModel, PrefillCoeffs, TransferCoeffs
from splitserve.perf.presets import preset


def req(rid, num_tokens, computed=0, prompt_len=None) -> QueuedRequest:
    return QueuedRequest(key=StageKey(rid, 0), arrival_time=0.0, prompt_len=num_tokens if prompt_len is None else
                         prompt_len, num_tokens=num_tokens, num_computed_tokens=computed)


def decode(rid, ctx) -> QueuedRequest:
    """A running request with ctx tokens of KV past a prompt of ctx tokens: one token to feed."""
    return req(rid, ctx + 1, ctx, prompt_len=ctx)


def chunk(rid, prompt_len, computed) -> QueuedRequest:
    """A running request part-way through its prefill."""
    return req(rid, prompt_len, computed)


class FakeStep:
    """A StepBuilder over plain queues that enforces the contract as the core does; requests in
    `no_memory` get 0 from `add` (a running one is then preempted)."""

    def __init__(self, running, waiting, budget: StepBudget, no_memory=()):
        self.running, self.waiting, self.budget = list(running), list(waiting), budget
        self._views = {r.key: r for r in [*running, *waiting]}
        self._running_keys = {r.key for r in running}
        self._no_memory = {StageKey(rid, 0) for rid in no_memory}
        self._num_running = len(running)
        self._tokens_left = budget.max_num_batched_tokens
        self.calls: list[tuple[str, int, int]] = []
        self.preempted: list[StageKey] = []

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
        if any(rid == key.request_id and granted for rid, _, granted in self.calls):
            raise PolicyContractError(f"{key} twice")
        if not 1 <= num_tokens <= min(view.num_remaining_tokens, self._tokens_left):
            raise PolicyContractError(f"{key}: {num_tokens} tokens")
        granted = num_tokens
        if key in self._running_keys:
            if key in self._no_memory:
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
        raise AssertionError("prefill_first never preempts on its own")

    def hold_until(self, t: float) -> None:
        raise AssertionError("prefill_first never holds work back")


BUDGET = StepBudget(max_num_batched_tokens=2048, max_num_seqs=256)


def run(policy, running, waiting, budget=BUDGET, no_memory=()) -> list[tuple[str, int]]:
    step = FakeStep(running, waiting, budget, no_memory)
    assert policy.next_batch(step, 0.0) is None
    return [(rid, granted) for rid, _, granted in step.calls if granted]


# ---- over hand-made queues ----------------------------------------------------------------------


def test_registered_with_options_and_driver_flags():
    assert "prefill_first" in known_batch_policies()
    policy = build_batch_policy("prefill_first", {"mixed": "true", "max_decode_stall": "3"},
                                perf_model=preset("H100", "Llama-3-8B"))
    assert isinstance(policy, PrefillFirstPolicy) and policy.mixed and policy.max_decode_stall == 3
    assert make_batch_policy("prefill_first").mixed is False and make_batch_policy("prefill_first").max_decode_stall == 8
    for bad in ({"max_decode_stall": "0"}, {"max_decode_stall": "x"}, {"mixed": "maybe"}, {"window": 3}):
        with pytest.raises(ValueError, match="bad options for batch policy 'prefill_first'"):
            make_batch_policy("prefill_first", **bad)
    assert PrefillFirstPolicy.observes_steps is False and PrefillFirstPolicy.steady_decodes is True


def test_prefills_run_before_decodes_and_alone_in_their_step():
    running = [decode("d1", 500), chunk("c", 3000, 2048), decode("d2", 80)]
    waiting = [req("w1", 700), req("w2", 900)]
    # Running chunk first (oldest first among prefills), then the waiting queue in order; no decode.
    assert run(PrefillFirstPolicy(), running, waiting) == [("c", 952), ("w1", 700), ("w2", 396)]
    # fcfs serves the same queues decodes first.
    fcfs = FakeStep(running, waiting, BUDGET)
    FcfsPolicy().next_batch(fcfs, 0.0)
    assert [(rid, n) for rid, _, n in fcfs.calls if n][:2] == [("d1", 1), ("c", 952)]


def test_mixed_gives_the_decodes_what_the_prefills_left():
    running = [decode("d1", 500), decode("d2", 80)]
    assert run(PrefillFirstPolicy(mixed=True), running, [req("w", 700)]) == [("w", 700), ("d1", 1), ("d2", 1)]
    # A prefill that takes the whole budget leaves nothing: the decodes wait (a stall).
    policy = PrefillFirstPolicy(mixed=True)
    assert run(policy, running, [req("w", 5000)]) == [("w", 2048)]
    assert policy.stalled == 1


def test_budget_and_seq_limit_hold():
    budget = StepBudget(max_num_batched_tokens=1000, max_num_seqs=3)
    running = [decode("d1", 10)]
    waiting = [req("a", 300), req("b", 400), req("c", 500)]
    # Two admissions fill the seq limit (1 running + 2); the token budget is never exceeded.
    assert run(PrefillFirstPolicy(), running, waiting, budget) == [("a", 300), ("b", 400)]
    assert run(PrefillFirstPolicy(), [], [req("x", 5000)], budget) == [("x", 1000)]


def test_decodes_run_when_no_prefill_waits_or_none_can_be_admitted():
    running = [decode("d1", 500), decode("d2", 80)]
    policy = PrefillFirstPolicy()
    assert run(policy, running, []) == [("d1", 1), ("d2", 1)]
    # The head of the queue finds no KV memory: nothing is admitted (nobody overtakes it), the decodes run.
    assert run(policy, running, [req("w1", 700), req("w2", 10)], no_memory=("w1",)) == [("d1", 1), ("d2", 1)]
    assert policy.stalled == 0


def test_a_decode_waits_at_most_max_decode_stall_steps():
    policy = PrefillFirstPolicy(max_decode_stall=3)
    running = [decode("d1", 500)]
    served = []
    for i in range(12):  # a new prefill waits at every step, forever
        served.append(("d1", 1) in run(policy, running, [req(f"w{i}", 700)]))
    # Three prefill-only steps, then a decode-first step (which still admits the prefill), and again.
    assert served == [False, False, False, True] * 3
    pairs = run(PrefillFirstPolicy(max_decode_stall=1), running, [])
    assert pairs == [("d1", 1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), max_size=6), st.lists(st.integers(1, 3000), max_size=6),
       st.integers(0, 6), st.integers(1, 4), st.booleans(), st.integers(1, 4096), st.integers(1, 12))
def test_contract_ordering_and_no_starvation_on_any_queues(chunks, waits, decodes, stall, mixed, budget, seqs):
    """Any queues: the contract holds (FakeStep raises otherwise), every prefill is scheduled
    before any decode unless the step is decode-first, and, where the budget holds every running
    request (max_num_batched_tokens >= max_num_seqs, as in any real configuration), a decode is
    never skipped more than `stall` steps in a row."""
    policy = PrefillFirstPolicy(mixed=mixed, max_decode_stall=stall)
    running = [decode(f"d{i}", 100 + i) for i in range(decodes)] + [chunk(f"c{i}", n + 10, 10)
                                                                     for i, n in enumerate(chunks)]
    running = running[:seqs]
    limits = StepBudget(max_num_batched_tokens=budget, max_num_seqs=max(seqs, len(running)))
    skipped_in_a_row = 0
    for _ in range(3 * stall + 2):
        before = policy.stalled
        pairs = run(policy, running, [req(f"w{i}", n) for i, n in enumerate(waits)], limits)
        kinds = [rid[0] for rid, _ in pairs]
        if before < stall and "d" in kinds:
            assert "d" not in kinds[:kinds.index("d")] and all(k == "d" for k in kinds[kinds.index("d"):])
        if any(r.is_decode for r in running) and budget >= len(running):  # the budget holds every decode
            all_decodes = sum(k == "d" for k in kinds) == sum(r.is_decode for r in running)
            skipped_in_a_row = 0 if all_decodes else skipped_in_a_row + 1
            assert skipped_in_a_row <= stall
        assert sum(n for _, n in pairs) <= budget


# ---- on the real scheduler ---------------------------------------------------------------------

MODEL = preset("H100", "Llama-3-8B")


def test_on_the_scheduler_a_new_prompt_preempts_the_decodes_turn_and_fcfs_does_not():
    plans = {}
    for policy in (FcfsPolicy(), PrefillFirstPolicy()):
        sched = policy_scheduler(policy, budget=512)
        add_request(sched, "old", 100, max_tokens=20)
        run_step(sched, MODEL)  # old's prefill: it decodes from now on
        add_request(sched, "new", 1200, max_tokens=2)
        plans[policy.name] = [sorted((e.seq.request_id, e.num_new_tokens) for e in run_step(sched, MODEL).entries)
                              for _ in range(4)]
    # fcfs: old decodes in every step, new's prefill takes the rest of the budget (511, 511, 178).
    assert plans["fcfs"][0] == [("new", 511), ("old", 1)]
    assert all(("old", 1) in step for step in plans["fcfs"])
    # prefill_first: new's prefill in three prefill-only steps, then old decodes again beside new's.
    assert plans["prefill_first"][:3] == [[("new", 512)], [("new", 512)], [("new", 176)]]
    assert plans["prefill_first"][3] == [("new", 1), ("old", 1)]


# ---- whole simulations ---------------------------------------------------------------------------

TOY = PerfModel(PrefillCoeffs(c0=1e-3, c_tok=1e-5), DecodeCoeffs(c0=2e-3, c_seq=1e-4, c_ctx=1e-7),
                TransferCoeffs(latency=1e-4, per_token=1e-6), label="toy")


def items() -> list:
    sessions = [Session(f"s{i}", [Round(300, 20, 0.0), Round(200, 30, 0.05), Round(100, 10, 0.02)]) for i in range(4)]
    return [SimRequestSpec(f"req-{i}", 100 + 37 * i, 5 + 11 * (i % 7)) for i in range(24)] + sessions


def simulate(batch_policy: str, fast: bool, max_num_seqs: int = 256):
    sim = Simulator(2, TOY, num_kv_blocks=150, max_num_batched_tokens=256, max_num_seqs=max_num_seqs,
                    batch_policy=batch_policy, fast_forward=fast, view_refresh_s=0.01, latency=NetworkLatency(),
                    placement_policy="least_loaded")
    return sim.run(items(), arrivals.poisson(30.0), seed=3)


@pytest.mark.parametrize("max_num_seqs", [256, 3])
def test_fast_forward_gives_the_same_results_as_stepping(max_num_seqs):
    slow, fast = simulate("prefill_first", False, max_num_seqs), simulate("prefill_first", True, max_num_seqs)
    assert [(r.request_id, r.token_times_s) for r in slow.results] == [(r.request_id, r.token_times_s)
                                                                        for r in fast.results]
    assert all(r.ok for r in fast.results) and slow.stats.steps == fast.stats.steps


def test_in_a_simulation_first_tokens_come_sooner_and_gaps_grow_against_fcfs():
    results = {name: simulate(name, True).results for name in ("fcfs", "prefill_first")}
    assert all(r.ok for rows in results.values() for r in rows)
    ttft = {name: np.mean([r.ttft_s for r in rows]) for name, rows in results.items()}
    gap = {name: np.max(np.concatenate([r.itls_s for r in rows if len(r.itls_s)])) for name, rows in results.items()}
    assert ttft["prefill_first"] < ttft["fcfs"]
    assert gap["prefill_first"] > gap["fcfs"]
