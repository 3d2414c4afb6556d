"""One stage's state inside a worker's scheduler: tokens, progress, KV blocks, stop state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from splitserve.core.sampling import SamplingParams


class StageKey(NamedTuple):
    """Names one stage of one request on a worker (ARCHITECTURE "the stage").

    A request split across workers has one stage per worker; a worker may hold two stages
    of one request (a migration that lands where an earlier stage ran), so the key is the
    pair, never a string to be parsed back.
    """

    request_id: str
    stage_index: int = 0

    def __str__(self) -> str:  # logs, metrics and default transfer ids
        return f"{self.request_id}/{self.stage_index}"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller
    STAGE_END = "stage_end"  # this stage's token range is done; another stage continues


class OutputText(Protocol):
    """Turns a stage's new tokens into text and matches stop strings (a detokenizer).

    The scheduler calls it with every appended token so that a stop string finishes the
    stage in the same place any other stop condition does; the implementation
    (`splitserve.detokenizer.IncrementalDetokenizer`) holds the tokenizer, which the
    core never imports.
    """

    stopped: bool

    def push(self, token_ids: list[int], final: bool = False) -> str: ...


class OutputConstraint(Protocol):
    """What the output may be next (structured output: a grammar matcher).

    The scheduler feeds it every appended token, as it does the detokenizer; a terminated
    constraint (the grammar's end accepted) finishes the stage with "stop". The implementation
    (`workers.engine.structured.GrammarConstraint`) also masks the logits before sampling; it has
    accepted the earlier stages' output, so every stage continues the same grammar state.
    """

    @property
    def terminated(self) -> bool: ...

    def accept(self, token_id: int) -> bool: ...


@dataclass(frozen=True)
class SessionHold:
    """A stage that ends one round of a session: pin its KV under the session when it finishes
    (`splitserve.core.session_pins`)."""

    session_id: str
    ttl_s: float  # idle time after which the pin is dropped
    history_len: int = 0  # tokens of history the coordinator expects this worker to hold (0: first round)

    def __post_init__(self) -> None:
        if not self.session_id:
            raise ValueError("session_id must not be empty")
        if not self.ttl_s > 0:
            raise ValueError(f"session ttl_s must be > 0, got {self.ttl_s}")
        if self.history_len < 0:
            raise ValueError(f"session history_len must be >= 0, got {self.history_len}")


@dataclass(eq=False, slots=True)
class Sequence:
    """A stage's view of its request's logical sequence: prompt then output, positions 0..L."""

    key: StageKey
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    arrival_time: float
    # Keep KV blocks after finishing until `Scheduler.release` (a push or pull still reads them).
    keep_kv: bool = False
    # A non-final stage stops once KV covers tokens [0, stop_at) (ARCHITECTURE "the stage").
    stop_at: int | None = None
    priority: int = 0
    ttft_deadline: float | None = None  # arrival + TTFT objective (clock seconds); None: none
    admitted_time: float | None = None  # when first moved to running (clock seconds): its queue wait ends
    itl_slo_s: float | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids, extended lazily (prefix caching) by
    # `BlockManager.update_block_hashes` only.
    block_hashes: list[int] = field(default_factory=list)
    # How far `BlockManager.commit_computed` has indexed this block table (see there).
    commit_state: tuple | None = None
    # (the block manager's index-removal count, cached blocks found) of the last
    # `BlockManager.cached_prefix_hint_tokens` (see there).
    prefix_hint: tuple[int, int] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    text: OutputText | None = None  # None: no detokenisation (token ids only)
    constraint: OutputConstraint | None = None  # structured output: the grammar the output follows
    # The session round this stage ends: its KV is pinned under the session when it finishes.
    session: SessionHold | None = None

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def end(self) -> int:
        """Tokens this stage may compute KV for: all known ones, bounded by `stop_at`."""
        n = len(self.token_ids)
        return n if self.stop_at is None or self.stop_at > n else self.stop_at

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens this stage may still compute KV for (bounded by `stop_at`)."""
        return self.end - self.num_computed_tokens

    @property
    def reached_stage_end(self) -> bool:
        return self.stop_at is not None and self.num_computed_tokens >= self.stop_at

    @property
    def in_prefill(self) -> bool:
        """True while more than the newest token still lacks KV (prompt or recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
