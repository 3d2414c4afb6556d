"""What a benchmark sends: requests and session plans with concrete prompt token ids.

The pure workload descriptions (shapes, traces, session presets) become lists of
:class:`BenchRequest` or :class:`SessionPlan` here, with every prompt token drawn up
front from one seeded generator, so a seed pins the whole run's input. The
:class:`Target` protocol is the one interface the runner talks to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from loadgen.metrics import RequestResult
from loadgen.sessions import Session
from loadgen.traces import TraceRequest
from loadgen.workloads import PrefixBlockTokens, RequestShape, make_prompt_tokens

__all__ = [
    "BenchRequest",
    "StreamedResult",
    "Target",
    "PlannedRound",
    "SessionPlan",
    "requests_from_shapes",
    "requests_from_trace",
    "plan_sessions",
]


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: prompt token ids, tokens to generate, and its session round if any."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    session_id: str | None = None
    round_index: int = 0

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


@dataclass
class StreamedResult(RequestResult):
    """A :class:`RequestResult` plus the output token ids, when the target saw them."""

    output_token_ids: list[int] = field(default_factory=list, repr=False)


class Target(Protocol):
    """Something that serves a request; ``origin_s`` is the ``perf_counter`` value of time zero."""

    origin_s: float

    async def send(self, request: BenchRequest) -> RequestResult:
        """Send one request and return what was observed; never raises for serving errors."""
        ...


@dataclass(frozen=True)
class PlannedRound:
    """One session round: its new prompt tokens, tokens to generate, delay after the previous round.

    ``filler_output_ids`` stand in for the round's output in later rounds' history when
    the target does not report output token ids (OpenAI streams carry only text).
    """

    incr_prompt_ids: list[int]
    output_len: int
    delay_before_s: float
    filler_output_ids: list[int]


@dataclass(frozen=True)
class SessionPlan:
    """A multi-round session ready to send; round 0 is the initial prompt."""

    session_id: str
    rounds: list[PlannedRound]


def requests_from_shapes(
    shapes: Sequence[RequestShape],
    n: int,
    rng: np.random.Generator,
    vocab_size: int,
    id_prefix: str = "req",
) -> list[BenchRequest]:
    """``n`` requests cycling through ``shapes`` in order (so every shape is equally represented)."""
    if not shapes:
        raise ValueError("shapes: need at least one request shape")
    requests = []
    for i in range(n):
        shape = shapes[i % len(shapes)]
        prompt = make_prompt_tokens(shape.prompt_len, rng, 0, vocab_size)
        requests.append(BenchRequest(f"{id_prefix}-{i}", prompt, shape.output_len))
    return requests


def requests_from_trace(
    trace: Sequence[TraceRequest],
    rng: np.random.Generator,
    vocab_size: int,
    seed: int = 0,
    id_prefix: str = "req",
) -> list[BenchRequest]:
    """One request per trace row; Mooncake prefix blocks become identical token runs."""
    blocks = PrefixBlockTokens(0, vocab_size, seed)
    requests = []
    for i, row in enumerate(trace):
        if row.output_len < 1 or row.prompt_len < 1:
            raise ValueError(f"trace row {i}: prompt and output lengths must be >= 1 (scale with min 1)")
        requests.append(BenchRequest(f"{id_prefix}-{i}", blocks.prompt_tokens(row, rng), row.output_len))
    return requests


def plan_sessions(
    sessions: Sequence[Session],
    rng: np.random.Generator,
    vocab_size: int,
    run_tag: str = "",
) -> list[SessionPlan]:
    """Draw every session round's incremental prompt tokens (and output fillers) up front.

    ``run_tag`` is appended to session ids so repeated runs against one server (sweeps,
    capacity probes) never continue each other's sessions.
    """
    plans = []
    for session in sessions:
        rounds = [
            PlannedRound(
                incr_prompt_ids=make_prompt_tokens(r.incr_prompt_len, rng, 0, vocab_size),
                output_len=r.output_len,
                delay_before_s=r.delay_before_s,
                filler_output_ids=make_prompt_tokens(r.output_len, rng, 0, vocab_size),
            )
            for r in session.rounds
        ]
        session_id = f"{session.session_id}-{run_tag}" if run_tag else session.session_id
        plans.append(SessionPlan(session_id, rounds))
    return plans
