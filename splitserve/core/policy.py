"""The local batch-policy contract: what a policy sees, and the one way it builds a step.

A worker's scheduler owns the queues and the KV memory; a `BatchPolicy` decides, each
step, which requests run and how many tokens each computes. The policy gets a
`StepBuilder` over plain snapshots of the queues (`QueuedRequest`) and builds the step
through it:

* **order** — requests are scheduled in the order the policy adds them (AMPD's
  look-ahead reordering, Alg. 2, picks any order within its window);
* **budget** — each `add` takes as many tokens as the policy grants (DynaServe Alg. 2's
  prefill budget from its latency table; LAPS' fixed long-prefill chunks C_l;
  dLLM-Serve's phase costs: a Refresh request costs its whole sequence, a Reuse request
  one block);
* **hold back** — a request the policy does not add waits; `hold_until(t)` tells the
  driver to look again by `t` even if nothing else happens (LAPS' AWD batching waits up
  to its window W for a fuller batch).

The builder enforces what no policy may break (each request once, the token budget,
`max_num_seqs`, at most the tokens a request has left): breaking it raises
`PolicyContractError`, a bug in the policy, never repaired silently. What a policy
cannot know in advance is whether KV memory suffices: `add` answers that, after the
scheduler's one preemption rule (recompute the newest running request not yet in this
step); a policy that wants first-come-first-served stops at the first waiting request
that did not fit, another may skip it.

**Scheduling policy** (vLLM's `--scheduling-policy`): under `fcfs` (the default) the waiting
queue is in arrival order, preempted requests first, and the victim of a preemption is the
newest running request; under `priority` the scheduler shows the policy the waiting requests
ordered by `(priority, arrival)` (a lower value first, as vLLM) and preempts the running
request with the largest `(priority, arrival)` first, the growing request itself when that is
it. A policy says which by its `scheduling_policy` attribute, which
`make_batch_policy(name, scheduling_policy=...)` sets for any registered policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

from splitserve.core.sequence import StageKey
from splitserve.core.step_cost import StepShape


FCFS = "fcfs"
PRIORITY = "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)


def scheduling_policy_option(value: object) -> str:
    """A scheduling policy's name; ValueError naming the option and the choices."""
    text = str(value).strip().lower() if value is not None else FCFS
    if text not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {' | '.join(SCHEDULING_POLICIES)}, got {value!r}")
    return text


class _Prioritised(Protocol):
    priority: int
    arrival_time: float


def priority_key(req: _Prioritised) -> tuple[int, float]:
    """Where a request stands under the priority policy: lower first, ties by arrival."""
    return req.priority, req.arrival_time


class PolicyContractError(ValueError):
    """A batch policy asked for a step the scheduler must not run (a bug in the policy)."""


class QueuedRequest(NamedTuple):
    """What a policy may know about one stage in the scheduler's queues (immutable: a tuple,
    built for every queued stage at every step, so it must be cheap to make)."""

    key: StageKey
    arrival_time: float
    prompt_len: int
    num_tokens: int  # tokens this stage may compute KV for (known tokens, bounded by its end)
    num_computed_tokens: int  # tokens with KV in place (cached prefix and transferred KV included)
    priority: int = 0
    ttft_deadline: float | None = None  # arrival + TTFT objective; None: no objective
    itl_slo_s: float | None = None
    num_preemptions: int = 0

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def deadline(self, default_ttft_slo_s: float | None = None) -> float | None:
        """Its TTFT deadline (clock seconds): the request's own, else arrival + the policy's
        default objective; None: no objective."""
        if self.ttft_deadline is not None:
            return self.ttft_deadline
        if default_ttft_slo_s is not None:
            return self.arrival_time + default_ttft_slo_s
        return None

    @property
    def is_decode(self) -> bool:
        """One new token past the prompt: the step samples the next output token."""
        return self.num_remaining_tokens == 1 and self.num_computed_tokens >= self.prompt_len


@dataclass(frozen=True)
class StepBudget:
    """Limits of one engine step."""

    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class ExecutedBatch:
    """Feedback after a step ran: its shape and measured (or modelled) latency."""

    shape: StepShape
    latency_s: float


class StepBuilder(Protocol):
    """The scheduler's half of the contract, handed to `BatchPolicy.next_batch`."""

    running: Sequence[QueuedRequest]  # oldest first
    waiting: Sequence[QueuedRequest]  # queue order (preempted requests first); priority: by `priority_key`
    budget: StepBudget

    @property
    def tokens_left(self) -> int:
        """Tokens this step may still take."""

    @property
    def seqs_left(self) -> int:
        """Waiting requests this step may still admit (max_num_seqs minus running and admitted)."""

    @property
    def preempted_any(self) -> bool:
        """Whether this step preempted a request (then no waiting request is admitted)."""

    @property
    def kv_free_fraction(self) -> float:
        """Free KV blocks over all blocks, as the step's additions so far left them (O(1))."""

    @property
    def kv_reclaimable_fraction(self) -> float:
        """Blocks that only idle session pins hold, over all blocks: another session's request
        gets them once the free ones are used up, before any running request is preempted
        (`SessionPins.evict_lru`). O(pinned blocks): read it only when the free share is low."""

    def add(self, key: StageKey, num_tokens: int) -> int:
        """Schedule `num_tokens` of this request's remaining tokens; how many it got (0: none).

        0 means KV memory: a running request that could not grow even after preempting
        every other running request not yet in the step was preempted itself; a waiting
        one found no blocks, or this step preempted something (admitting would thrash).
        A waiting request may get fewer tokens than asked when its cached prefix grew.
        """

    def preempt(self, key: StageKey) -> None:
        """Preempt a running request not in this step (its KV is dropped and recomputed later)."""

    def hold_until(self, t: float) -> None:
        """Work is held back on purpose: have the driver schedule again by clock time `t`."""


class BatchPolicy(Protocol):
    """Chooses each step's batch from the queues (pure: its decisions depend only on what
    it is shown, its own state and `now`).

    Class attributes a policy may set (defaults in brackets), read by drivers:
    `observes_steps` [True]: False when `observe` ignores its argument, so a driver may
    skip the calls (the simulator applies millions of decode steps in bulk);
    `steady_decodes` [False]: True when, with only decodes running and nothing it could
    admit, the policy always schedules every running request with one token whatever
    the time, so identical decode steps may be fast-forwarded;
    `scheduling_policy` ["fcfs"]: "priority" orders the waiting queue and the preemption
    victims by `priority_key` (see the module's docstring).
    """

    name: str

    def next_batch(self, step: StepBuilder, now: float) -> None:
        """Build this step through `step` (an empty step is legal: nothing runs)."""

    def observe(self, executed: ExecutedBatch) -> None:
        """Learn from a finished step (policies with online latency profiles)."""
