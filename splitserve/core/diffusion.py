"""Diffusion LLM serving on the core (dLLM-Serve): a request's denoising state and the step scheduler.

A diffusion request (LLaDA) is its prompt followed by `gen_length` mask tokens, decoded in
blocks of `block_length`, left to right, `steps_per_block` denoising steps each (the
reference: `workers/diffusion/reference.py`). With a **dual cache** (Fast-dLLM style;
dLLM-Serve §2.3) a block's first step is a **Refresh**: the whole sequence is computed and
every position's keys/values are cached; the block's other steps are **Reuse** steps: only
the block's `block_length` positions are computed, against the cached context. With no
cache every step is a Refresh (the reference's full recompute).

`DiffusionScheduler` builds each step's batch (§4.4): the scheduling currency is **query
tokens** (a Refresh costs the sequence length, a Reuse one block), never more than
`max_num_batched_tokens` per step; the KV pool is a budget of cached tokens, a request's
footprint fixed at admission (the whole sequence, or `retention_ratio` of its context with
the sparse cache, §4.5). Two policies:

* `phase_multiplexed` (dLLM-Serve's greedy FCFS): the running requests in admission order
  take the budget by their phase cost; then waiting requests are admitted, first come first
  served, into what is left — the headroom that requests moving from Refresh to Reuse free.
* `static` (the request-level baseline: Fast-dLLM's static batch): a batch of up to
  `static_batch_size` requests is admitted only when the previous batch has fully drained,
  provisioned for its Refresh peak (the batch's sequences must fit the budget together).

Pure: plain numbers in, plain numbers out; the clock is injected by the callers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from splitserve.core.errors import InvalidInput

__all__ = ["CACHE_MODES", "DEFAULT_BLOCK_LENGTH", "DIFFUSION_POLICIES", "REMASKING_STRATEGIES", "DiffusionBatch",
           "DiffusionParamError", "DiffusionParams", "DiffusionScheduler", "DiffusionSchedulerConfig",
           "DiffusionSequence", "DiffusionWork", "Phase", "diffusion_params", "profile_batch",
           "transfer_token_schedule"]

REMASKING_STRATEGIES = ("low_confidence", "random")
CACHE_MODES = ("none", "dual")
DIFFUSION_POLICIES = ("phase_multiplexed", "static")
DEFAULT_BLOCK_LENGTH = 32


class DiffusionParamError(InvalidInput):
    """A request's denoising knob out of range; `param` names the field (the API's 400 carries it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param=param)


def _positive_param(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DiffusionParamError(name, f"{name} must be a positive int, got {value!r}")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DiffusionParams:
    """A request's denoising knobs (LLaDA's `generate`), validated; errors name the field."""

    gen_length: int = 128
    block_length: int = 128
    steps: int = 128
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    # Share of the context (positions outside the current block) whose KV a Reuse step reads
    # (dLLM-Serve §4.5); 1: all of it (dense).
    retention_ratio: float = 1.0

    def __post_init__(self) -> None:
        for name in ("gen_length", "block_length", "steps"):
            _positive_param(name, getattr(self, name))
        if self.gen_length % self.block_length:
            raise DiffusionParamError("block_length", f"block_length ({self.block_length}) must divide the "
                                      f"generated length (max_tokens = {self.gen_length})")
        if self.steps % self.num_blocks:
            raise DiffusionParamError("steps", f"steps ({self.steps}) must be a multiple of the number of blocks "
                                      f"(max_tokens / block_length = {self.num_blocks})")
        if self.steps > self.gen_length:
            raise DiffusionParamError("steps", f"steps ({self.steps}) must be <= max_tokens ({self.gen_length}): "
                                      "each step unmasks at least one token")
        for name in ("temperature", "cfg_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 or math.isinf(value):
                raise DiffusionParamError(name, f"{name} must be a finite number >= 0, got {value!r}")
        if self.remasking not in REMASKING_STRATEGIES:
            raise DiffusionParamError("remasking", f"remasking must be one of {list(REMASKING_STRATEGIES)}, "
                                      f"got {self.remasking!r}")
        r = self.retention_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= 1:
            raise DiffusionParamError("retention_ratio", f"retention_ratio must be in (0, 1], got {r!r}")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def uses_randomness(self) -> bool:
        return self.temperature > 0 or self.remasking == "random"


def transfer_token_schedule(masked_count: int, steps: int) -> list[int]:
    """How many of `masked_count` masked tokens each of `steps` steps unmasks (LLaDA's
    `get_num_transfer_tokens`): the same number every step, the remainder one each to the
    first steps, so the schedule sums to `masked_count`."""
    if masked_count < 0:
        raise ValueError(f"masked_count must be >= 0, got {masked_count}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base, remainder = divmod(masked_count, steps)
    return [base + 1 if step < remainder else base for step in range(steps)]


def diffusion_params(max_tokens: int, *, steps: int | None = None, block_length: int | None = None,
                     temperature: float = 0.0, remasking: str = "low_confidence",
                     retention_ratio: float = 1.0, cfg_scale: float = 0.0) -> DiffusionParams:
    """A request's denoising knobs from its API fields, the defaults filled in: one step per
    token; blocks of 32 when 32 divides max_tokens (and the steps), else one block.
    DiffusionParamError names the field. The gateway (its 400s) and the engine share it."""
    block = block_length
    if block is None:
        block = DEFAULT_BLOCK_LENGTH if max_tokens % DEFAULT_BLOCK_LENGTH == 0 else max_tokens
        if steps is not None and max_tokens >= block and steps % (max_tokens // block):
            block = max_tokens  # the default blocks would not divide these steps: one block
    return DiffusionParams(gen_length=max_tokens, block_length=block, steps=max_tokens if steps is None else steps,
                           temperature=temperature, remasking=remasking or "low_confidence",
                           retention_ratio=retention_ratio, cfg_scale=cfg_scale)


class Phase(str, Enum):
    REFRESH = "refresh"  # the whole sequence computed; the cache (re)built
    REUSE = "reuse"  # the current block computed against the cached context


@dataclass
class DiffusionSequence:
    """One request's denoising progress (what the scheduler needs; the tokens live in the runner)."""

    key: str
    prompt_len: int
    params: DiffusionParams
    arrival_s: float = 0.0
    block: int = 0  # the current block
    step_in_block: int = 0
    finished: bool = False

    @property
    def length(self) -> int:
        return self.prompt_len + self.params.gen_length

    @property
    def block_start(self) -> int:
        return self.prompt_len + self.block * self.params.block_length

    def phase(self, cache: str) -> Phase:
        return Phase.REFRESH if cache == "none" or self.step_in_block == 0 else Phase.REUSE

    def query_tokens(self, cache: str) -> int:
        """This step's cost in query tokens (§4.4): the sequence in Refresh, a block in Reuse;
        with classifier-free guidance twice that (a second pass sees the prompt masked)."""
        tokens = self.length if self.phase(cache) is Phase.REFRESH else self.params.block_length
        return 2 * tokens if self.params.cfg_scale > 0 else tokens

    def kv_tokens(self, cache: str) -> int:
        """Tokens of KV held between steps, fixed for the request's life (§4.5: allocated once)."""
        if cache == "none":
            return 0
        if self.params.retention_ratio >= 1:
            return self.length
        return retained_tokens(self.length - self.params.block_length, self.params.retention_ratio)

    @property
    def num_transfer(self) -> int:
        """Transfers this step makes: positions written with the model's prediction (a prediction
        that is the mask token itself leaves its position masked, as in LLaDA's reference)."""
        p = self.params
        return transfer_token_schedule(p.block_length, p.steps_per_block)[self.step_in_block]

    @property
    def steps_done(self) -> int:
        return self.block * self.params.steps_per_block + self.step_in_block

    def advance(self) -> bool:
        """One step done; True when it completed its block (the block's tokens are final)."""
        self.step_in_block += 1
        if self.step_in_block < self.params.steps_per_block:
            return False
        self.step_in_block = 0
        self.block += 1
        self.finished = self.block >= self.params.num_blocks
        return True


def retained_tokens(context_tokens: int, retention_ratio: float) -> int:
    """k: the context positions a sparse cache keeps per head (at least one)."""
    return max(1, min(context_tokens, math.ceil(retention_ratio * context_tokens)))


@dataclass(frozen=True)
class DiffusionWork:
    """One request's part of a step."""

    seq: DiffusionSequence
    phase: Phase
    query_tokens: int
    admitted: bool  # its first step: the runner sets its state up


@dataclass
class DiffusionBatch:
    entries: list[DiffusionWork] = field(default_factory=list)

    @property
    def num_query_tokens(self) -> int:
        return sum(e.query_tokens for e in self.entries)

    @property
    def num_logit_rows(self) -> int:
        """Rows whose logits the step needs: each request's current block (a Refresh step also
        re-predicts positions left masked in earlier blocks; `max_num_logits` chunking bounds the rest)."""
        return sum(e.seq.params.block_length for e in self.entries)


def profile_batch(max_num_batched_tokens: int, max_model_len: int, max_num_logits: int) -> DiffusionBatch:
    """The worst step the scheduler can build (dLLM-Serve §4.2's dummy workload): Refresh steps
    of sequences as long as the model allows, filling `max_num_batched_tokens` query tokens,
    whose blocks hold as many logit rows as a step can materialise at once (`max_num_logits`,
    or every query token but the prompts' first when fewer). The profiler runs it to measure
    the activation peak, logits included."""
    _positive_int("max_num_batched_tokens", max_num_batched_tokens)
    _positive_int("max_num_logits", max_num_logits)
    if not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 (a prompt token and a generated one), got {max_model_len!r}")
    batch, left, rows_left, index = DiffusionBatch(), max_num_batched_tokens, max_num_logits, 0
    while left > 0:
        length = max(2, min(left, max_model_len))
        block = max(1, min(rows_left, length - 1))
        rows_left = max(0, rows_left - block)
        prompt = length - block
        seq = DiffusionSequence(f"profile-{index}", prompt, DiffusionParams(gen_length=block, block_length=block,
                                                                             steps=block))
        batch.entries.append(DiffusionWork(seq, Phase.REFRESH, seq.length, admitted=True))
        left -= seq.length
        index += 1
    return batch


@dataclass(frozen=True)
class DiffusionSchedulerConfig:
    max_num_batched_tokens: int = 4096  # query tokens per step (§4.4's invariant)
    max_num_seqs: int = 64
    kv_capacity_tokens: int = 1 << 20  # the KV pool, in cached tokens
    cache: str = "dual"
    policy: str = "phase_multiplexed"
    static_batch_size: int = 8  # the static baseline's batch

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "kv_capacity_tokens", "static_batch_size"):
            _positive_int(name, getattr(self, name))
        if self.cache not in CACHE_MODES:
            raise ValueError(f"dllm_cache must be one of {list(CACHE_MODES)}, got {self.cache!r}")
        if self.policy not in DIFFUSION_POLICIES:
            raise ValueError(f"diffusion policy must be one of {list(DIFFUSION_POLICIES)}, got {self.policy!r}")


class DiffusionScheduler:
    """Waiting queue and running set of diffusion requests; one batch per `schedule`."""

    def __init__(self, config: DiffusionSchedulerConfig):
        self.config = config
        self.waiting: deque[DiffusionSequence] = deque()
        self.running: list[DiffusionSequence] = []  # admission order
        self.kv_used_tokens = 0

    def check_fits(self, seq: DiffusionSequence) -> None:
        """A request that could never run alone is refused up front (the error names the limit)."""
        c = self.config
        if seq.params.cfg_scale > 0 and 2 * seq.length > c.max_num_batched_tokens:
            raise DiffusionParamError("cfg_scale", f"cfg_scale: a guided Refresh computes prompt + max_tokens = "
                                      f"{seq.length} tokens twice, {2 * seq.length} > max_num_batched_tokens "
                                      f"({c.max_num_batched_tokens})")
        if seq.length > c.max_num_batched_tokens:
            raise InvalidInput(f"prompt + gen_length = {seq.length} tokens exceeds max_num_batched_tokens "
                               f"({c.max_num_batched_tokens}): a Refresh step computes the whole sequence at once",
                               param="prompt")
        if seq.kv_tokens(c.cache) > c.kv_capacity_tokens:
            raise InvalidInput(f"the request's KV ({seq.kv_tokens(c.cache)} tokens) exceeds the KV pool "
                               f"({c.kv_capacity_tokens} tokens)", param="prompt")

    def add(self, seq: DiffusionSequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def abort(self, key: str) -> bool:
        for seq in self.running:
            if seq.key == key:
                self._release(seq)
                return True
        for seq in self.waiting:
            if seq.key == key:
                self.waiting.remove(seq)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> DiffusionBatch:
        c = self.config
        budget = c.max_num_batched_tokens
        batch = DiffusionBatch()
        for seq in self.running:
            cost = seq.query_tokens(c.cache)
            if cost <= budget:  # else it waits a step: those admitted before it went first
                batch.entries.append(DiffusionWork(seq, seq.phase(c.cache), cost, admitted=False))
                budget -= cost
        if c.policy == "static" and self.running:
            return batch  # request-level: no admission until the whole batch has drained
        limit = c.max_num_seqs if c.policy == "phase_multiplexed" else min(c.max_num_seqs, c.static_batch_size)
        while self.waiting and len(self.running) < limit:
            seq = self.waiting[0]
            cost, kv = seq.query_tokens(c.cache), seq.kv_tokens(c.cache)
            if cost > budget or self.kv_used_tokens + kv > c.kv_capacity_tokens:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            self.running.append(seq)
            self.kv_used_tokens += kv
            batch.entries.append(DiffusionWork(seq, seq.phase(c.cache), cost, admitted=True))
            budget -= cost
        return batch

    def finish_step(self, batch: DiffusionBatch) -> tuple[list[DiffusionSequence], list[DiffusionSequence]]:
        """Advance every request the batch ran; returns (those whose block became final, those finished)."""
        final_block, finished = [], []
        for work in batch.entries:
            seq = work.seq
            if seq.finished or seq not in self.running:
                continue  # aborted while the step ran
            if seq.advance():
                final_block.append(seq)
            if seq.finished:
                finished.append(seq)
                self._release(seq)
        return final_block, finished

    def stop_early(self, key: str) -> bool:
        """A request ends before its last block (its output reached EOS): free its place."""
        for seq in self.running:
            if seq.key == key:
                seq.finished = True
                self._release(seq)
                return True
        return False

    def _release(self, seq: DiffusionSequence) -> None:
        self.running.remove(seq)
        self.kv_used_tokens -= seq.kv_tokens(self.config.cache)
