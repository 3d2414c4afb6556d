"""One request's state inside the engine: tokens, progress, KV blocks, stop state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller
    STAGE_END = "stage_end"  # this stage's token range is done; another stage continues


@dataclass
class Sequence:
    """A request's logical sequence: prompt followed by output, positions 0..L."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    arrival_time: float
    # Keep KV blocks after finishing until `Engine.release` (for export to another stage).
    keep_kv: bool = False
    # A non-final stage stops once KV covers tokens [0, stop_at) (ARCHITECTURE "the stage").
    stop_at: int | None = None
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids, extended lazily (prefix caching),
    # and those blocks' token tuples: hashed once, then shared with the blocks that index
    # them. Both are extended together, by `BlockManager.update_block_hashes` only.
    block_hashes: list[int] = field(default_factory=list)
    block_tokens: list[tuple[int, ...]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Incremental detokeniser (engine-private); None when the engine does not detokenise.
    detokenizer: object | None = None

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
    def num_schedulable_tokens(self) -> int:
        """Tokens this stage may still compute KV for (bounded by `stop_at`)."""
        end = len(self.token_ids) if self.stop_at is None else min(len(self.token_ids), self.stop_at)
        return end - self.num_computed_tokens

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
