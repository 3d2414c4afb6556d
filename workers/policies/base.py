"""The BatchPolicy interface and the plain data it decides over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class QueuedRequest:
    """What a policy may know about one request in the engine's queues."""

    request_id: str
    arrival_time: float
    prompt_len: int
    num_tokens: int  # tokens known so far (prompt + output)
    num_computed_tokens: int  # tokens with KV already in place (incl. cached prefix)
    priority: int = 0

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_remaining_tokens == 1 and self.num_computed_tokens >= self.prompt_len


@dataclass(frozen=True)
class StepBudget:
    """Limits of one engine step."""

    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class BatchEntry:
    request_id: str
    num_tokens: int


@dataclass
class Batch:
    """Requests to run this step, in priority order, each with its token count."""

    entries: list[BatchEntry] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass(frozen=True)
class ExecutedBatch:
    """Feedback after a step ran: its shape and measured latency."""

    num_prefill_tokens: int
    num_decode_seqs: int
    max_context_len: int
    latency_s: float


class BatchPolicy(Protocol):
    """Chooses the next batch from the running and waiting queues (pure)."""

    name: str
    # Optional class attribute `observes_steps = False`: observe() ignores what it is given,
    # so the simulator skips the calls in fast-forwarded runs of decode steps (millions in
    # a long run). Absent means True.

    def next_batch(
        self,
        running: Sequence[QueuedRequest],
        waiting: Sequence[QueuedRequest],
        budget: StepBudget,
        now: float,
    ) -> Batch: ...

    def observe(self, executed: ExecutedBatch) -> None:
        """Learn from a finished step (policies with online profiles)."""
