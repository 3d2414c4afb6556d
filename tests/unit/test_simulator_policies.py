"""A local batch policy written once runs unchanged in the simulator: it may hold work back
(the simulator wakes the worker when the hold ends) and budget each step."""

from __future__ import annotations

import pytest

from services.planner.simulator import NetworkLatency, Simulator
from services.planner.sim_workload import SimRequestSpec
from splitserve.core import FcfsPolicy, StepBuilder, register_batch_policy, unregister_batch_policy
from splitserve.perf.model import DecodeCoeffs, PerfModel, PrefillCoeffs, TransferCoeffs

TOY = PerfModel(PrefillCoeffs(c0=1e-3, c_tok=1e-5), DecodeCoeffs(c0=2e-3, c_seq=1e-4, c_ctx=1e-7),
                TransferCoeffs(latency=1e-4, per_token=1e-6), label="toy")
HOLD_S = 0.05


class HoldFirstArrivals(FcfsPolicy):
    """FCFS, but a waiting request is not admitted before it has waited HOLD_S (a stand-in
    for LAPS' wait-depth batching: wait for a fuller batch, bounded by a window)."""

    name = "hold_first_arrivals"
    steady_decodes = False

    def next_batch(self, step: StepBuilder, now: float) -> None:
        for req in step.running:
            step.add(req.key, min(req.num_remaining_tokens, step.tokens_left))
        for req in step.waiting:
            if now < req.arrival_time + HOLD_S:
                step.hold_until(req.arrival_time + HOLD_S)
                continue
            if step.tokens_left == 0 or step.seqs_left == 0 or not step.add(
                    req.key, min(req.num_remaining_tokens, step.tokens_left)):
                break


class PrefillBudget(FcfsPolicy):
    """Decodes first, then prefill chunks of at most 64 tokens in all per step (a fixed
    chunk, as LAPS' C_l; a budget, as DynaServe's MaxPrefillAllowed)."""

    name = "prefill_budget"

    def next_batch(self, step: StepBuilder, now: float) -> None:
        for req in step.running:
            if req.is_decode:
                step.add(req.key, 1)
        prefill_left = 64
        for req in [r for r in step.running if not r.is_decode] + list(step.waiting):
            n = min(req.num_remaining_tokens, prefill_left, step.tokens_left)
            if n == 0 or (req in step.waiting and step.seqs_left == 0):
                break
            prefill_left -= step.add(req.key, n)


@pytest.fixture
def policies():
    register_batch_policy(HoldFirstArrivals.name, HoldFirstArrivals)
    register_batch_policy(PrefillBudget.name, PrefillBudget)
    yield
    unregister_batch_policy(HoldFirstArrivals.name)
    unregister_batch_policy(PrefillBudget.name)


def sim(batch_policy: str) -> Simulator:
    return Simulator(1, TOY, num_kv_blocks=2000, batch_policy=batch_policy, latency=NetworkLatency(0.0, 0.0, 0.0))


def test_a_held_request_runs_when_its_hold_ends_though_nothing_else_happens(policies):
    result = sim(HoldFirstArrivals.name).run([SimRequestSpec("r", 100, 3)]).results[0]
    assert result.ok and result.output_len == 3
    # Nothing arrives or finishes at HOLD_S: only the hold's wake-up can start the prefill.
    assert result.ttft_s == pytest.approx(HOLD_S + TOY.prefill_time(0, 100), rel=1e-12)
    plain = sim("fcfs").run([SimRequestSpec("r", 100, 3)]).results[0]
    assert plain.ttft_s == pytest.approx(TOY.prefill_time(0, 100), rel=1e-12)


def test_each_arrival_waits_out_its_own_hold(policies):
    outcome = sim(HoldFirstArrivals.name).run([SimRequestSpec("a", 100, 2), SimRequestSpec("b", 100, 2)],
                                               [0.0, 0.01])
    a, b = outcome.results
    # a's hold ends at 0.05 and b's at 0.06; a is done (prefill + one decode) well before
    # 0.06, so b starts exactly when its hold ends, on an idle worker.
    assert a.first_token_s == pytest.approx(HOLD_S + TOY.prefill_time(0, 100), rel=1e-12)
    assert a.end_s < 0.01 + HOLD_S
    assert b.first_token_s == pytest.approx(0.01 + HOLD_S + TOY.prefill_time(0, 100), rel=1e-12)


def test_a_prefill_budget_policy_chunks_every_prompt(policies):
    result = sim(PrefillBudget.name).run([SimRequestSpec("r", 256, 2)]).results[0]
    chunks = sum(TOY.prefill_time(64 * i, 64) for i in range(4))
    assert result.ttft_s == pytest.approx(chunks, rel=1e-12)
