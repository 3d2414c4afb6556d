"""A local batch policy that holds work back, on the real engine and its engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.core import FcfsPolicy, StepBuilder, register_batch_policy, unregister_batch_policy
from workers.engine import Engine, EngineConfig, SamplingParams, StageSpec
from workers.engine_loop import EngineLoop

HOLD_S = 0.3


class HoldEveryArrival(FcfsPolicy):
    """FCFS once a waiting request has waited HOLD_S; until then it holds it back."""

    name = "hold_every_arrival"
    steady_decodes = False

    def next_batch(self, step: StepBuilder, now: float) -> None:
        for req in step.running:
            step.add(req.key, min(req.num_remaining_tokens, step.tokens_left))
        for req in step.waiting:
            if now < req.arrival_time + HOLD_S:
                step.hold_until(req.arrival_time + HOLD_S)
            elif step.seqs_left and step.tokens_left and not step.add(
                    req.key, min(req.num_remaining_tokens, step.tokens_left)):
                break


@pytest.fixture
def hold_policy():
    register_batch_policy(HoldEveryArrival.name, HoldEveryArrival)
    yield HoldEveryArrival.name
    unregister_batch_policy(HoldEveryArrival.name)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_held_stage_runs_nothing_until_the_hold_ends(tiny_model_dirs, hold_policy):
    clock = Clock()
    engine = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), batch_policy=hold_policy), clock=clock)
    engine.add_stage(StageSpec.whole("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0)))
    assert engine.step() == [] and engine.last_step_tokens == 0
    assert engine.last_output.hold_until == pytest.approx(100.0 + HOLD_S)
    clock.now += HOLD_S
    tokens = []
    while engine.has_unfinished():
        tokens += [t for ev in engine.step() for t in ev.token_ids]
    assert len(tokens) == 3


def test_the_engine_thread_wakes_itself_when_a_hold_ends(tiny_model_dirs, hold_policy):
    """No command arrives after the add: only the hold's own deadline can start the step."""
    engine = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), batch_policy=hold_policy))

    async def main() -> tuple[float, float]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), idle_wait_s=5.0)  # far longer than the hold
        loop.start()
        try:
            added = time.monotonic()
            events = await loop.add(StageSpec.whole("r", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0)))
            first = await asyncio.wait_for(events.get(), timeout=3.0)
            assert first.token_ids
            return added, time.monotonic()
        finally:
            loop.stop()

    added, first_token = asyncio.run(main())
    assert HOLD_S <= first_token - added < 3.0
