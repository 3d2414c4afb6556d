"""A worker's step scheduler: the one place that decides what a step runs (pure).

The contract, shaped like vLLM v1's scheduler interface:

    scheduler.add_stage(spec)                      # queue a stage (StageSpec)
    out = scheduler.schedule()                     # what the next step computes
    ... the driver executes `out` ...              # a forward pass, a sleep, or virtual time
    events = scheduler.update_from_output(out, sampled_tokens, latency_s)
    scheduler.abort(key) / scheduler.release(key)  # outside changes between steps

Drivers (`workers.engine.Engine`, the emulated engine, the simulator's worker) only
execute what `schedule()` returns and feed the results back; finishing, token appending,
KV accounting and step shape exist here once.

One token budget per step for prefill and decode together; chunked prefill; preemption
by recompute when blocks run out. Which requests run, in which order and with how many
tokens is the `BatchPolicy`'s choice, made through a `StepBuilder` (`splitserve.core.policy`);
this module keeps the queues and the memory, in the order the policy's `scheduling_policy`
names: arrival (fcfs) or `(priority, arrival)` for the waiting queue and the reverse for
preemption victims (priority, as vLLM's `--scheduling-policy priority`).

Every new stage waits, including one whose KV arrived from another worker (a later stage:
its blocks are already in its table). Such a stage is admitted, as any other, only under
`max_num_seqs`, so a decode worker fed by prefill workers never runs a larger batch than
configured; it waits holding its KV. That held KV is the one memory no step frees, so
where it would stop all progress (nothing else running, or the only running sequence
about to preempt itself) it is dropped, newest first, and those stages recompute
(`_drop_waiting_kv`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Mapping

from splitserve.core.block_manager import BlockManager
from splitserve.core.errors import InvalidInput, StageKeyTaken
from splitserve.core.policy import (PRIORITY, BatchPolicy, ExecutedBatch, PolicyContractError, QueuedRequest, StepBudget,
                                    priority_key, scheduling_policy_option)
from splitserve.core.sampling import SamplingParams, TokenLogprobs
from splitserve.core.sequence import FinishReason, OutputConstraint, OutputText, Sequence, SequenceStatus, StageKey
from splitserve.core.session_pins import SessionPins
from splitserve.core.stage import KvInBlocks, StageSpec
from splitserve.core.step_cost import StepShape
from splitserve.core.records import PrefillTask, WorkerLoad


class KvCapacityError(RuntimeError):
    """Not enough free KV blocks for a reservation right now (retry later or recompute)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one worker's scheduler and the model facts it checks requests against."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    # None: the token ids are not a model's (the simulator's stand-ins), so not range-checked.
    vocab_size: int | None
    eos_token_ids: frozenset[int] = frozenset()
    seed: int = 0  # draws the seeds of requests that bring none

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {self.vocab_size}")


@dataclass(slots=True)
class ScheduledEntry:
    """One sequence's share of a step: tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int  # KV of [0, start) is in place before the step
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step produces the sequence's next token."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    """One step: the entries to compute, who was preempted, and when to look again."""

    entries: list[ScheduledEntry] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # The policy held work back until this clock time: schedule again by then.
    hold_until: float | None = None
    shape: StepShape = StepShape()

    @classmethod
    def of(cls, entries: list[ScheduledEntry], preempted: list[Sequence] | None = None,
           hold_until: float | None = None) -> SchedulerOutput:
        """An output of these entries, with their step shape."""
        shape = StepShape.of((e.start, e.num_new_tokens, e.seq.prompt_len) for e in entries)
        return cls(entries, preempted or [], hold_until, shape)

    @property
    def num_tokens(self) -> int:
        return self.shape.num_tokens


@dataclass(slots=True)
class TokenEvent:
    """New output of one stage after a step; `finish_reason` set on its last event."""

    key: StageKey
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    # Seconds the stage waited before it was first scheduled (its trace's queue span); None: unknown.
    queue_wait_s: float | None = None
    # One per token of token_ids when the request asked for logprobs (SamplingParams.logprobs); else empty.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: the prompt tokens at positions prompt_logprobs_start, +1, ...
    # whose logprobs this stage computed since its previous event (they ride on the next event).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_start: int = 0

    @property
    def request_id(self) -> str:
        return self.key.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """Owns one worker's waiting and running queues and its KV blocks; decides each step."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: BatchPolicy,
                 clock: Callable[[], float]):
        self.config = config
        self.block_manager = block_manager
        self.policy = policy
        # Waiting order and preemption victims by (priority, arrival) instead of arrival.
        self.priority_order = scheduling_policy_option(getattr(policy, "scheduling_policy", None)) == PRIORITY
        self.budget = StepBudget(config.max_num_batched_tokens, config.max_num_seqs)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[StageKey, Sequence] = {}
        self.num_preemptions = 0
        # The last step found too few free KV blocks for a stage already here (one waiting was
        # refused admission, or a running one could not grow): blocks that free go to those
        # stages before any reservation waiting in line for another worker's push.
        self.kv_short = False
        self._seed_rng = random.Random(config.seed)
        # Prompt logprobs scored but not yet reported, by stage: (first position, logprobs).
        self._prompt_logprobs: dict[StageKey, tuple[int, list[TokenLogprobs]]] = {}
        # Session histories kept between rounds (AMPD); evicted before any running request is preempted.
        self.session_pins = SessionPins(block_manager)
        # Transferred new KV dropped because the history it continues was no longer cached here.
        self.kv_prefix_misses = 0
        # Prompts `hold_cached_prefix` hashed, (token ids, block hashes), most recent last: the
        # stage the lease is for arrives soon after with the same prompt and takes the hashes.
        self._leased_prompts: deque[tuple[list[int], list[int]]] = deque(maxlen=4)

    # ---- stages ------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_stage(self, spec: StageSpec, text: OutputText | None = None,
                  constraint: OutputConstraint | None = None) -> Sequence:
        """Queue a stage; InvalidInput naming the field for anything it cannot run (StageKeyTaken
        while an earlier attempt of the stage is still here).

        `text` detokenises the output and matches stop strings (it has seen the prompt and
        any earlier stages' output); without it, stop strings cannot be honoured. `constraint`
        is the request's structured output, having accepted any earlier stages' output.
        """
        if spec.key in self.sequences:
            raise StageKeyTaken(f"request_id {spec.key.request_id!r} (stage {spec.key.stage_index}) "
                                "is already in the engine")
        if spec.kv is not None and not isinstance(spec.kv, KvInBlocks):
            raise InvalidInput(f"kv: the scheduler takes KV already in blocks, got {type(spec.kv).__name__}",
                               param="kv")
        params = spec.sampling
        prompt, outputs = list(spec.prompt_ids), list(spec.output_ids)
        self._validate(prompt, outputs, spec, text)
        total = len(prompt) + params.max_tokens
        now = self.clock()
        arrival = now if spec.arrival_time is None else spec.arrival_time
        seq = Sequence(
            key=spec.key, token_ids=prompt + outputs, prompt_len=len(prompt), params=params,
            seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(63),
            arrival_time=arrival, keep_kv=spec.holds_kv_after_finish,
            stop_at=spec.end if spec.end is not None and spec.end < total else None,
            priority=spec.priority,
            ttft_deadline=arrival + spec.slo.ttft_s if spec.slo.ttft_s else None,
            itl_slo_s=spec.slo.itl_s or None, text=text, session=spec.session, constraint=constraint,
        )
        if spec.session is not None:
            self.session_pins.note_round(spec.session)
            self.session_pins.seed_block_hashes(spec.session.session_id, seq)
        self._seed_from_leased_prompts(seq)
        if isinstance(spec.kv, KvInBlocks):
            self._adopt(seq, spec.kv)
        self.sequences[seq.key] = seq
        self.waiting.append(seq)
        return seq

    def _adopt(self, seq: Sequence, kv: KvInBlocks) -> None:
        """Take transferred KV as the stage's start. KV of [start, n) only (AMPD: the new KV of
        a remote incremental prefill) needs [0, start) in this worker's prefix cache, where the
        session's pinned history is; should it be gone, the transfer is dropped and the stage
        computes from tokens (still exact, only slower)."""
        bm = self.block_manager
        prefix: list[int] = []
        if kv.start:
            if kv.start % bm.block_size:
                raise InvalidInput(f"kv start must be a multiple of the block size {bm.block_size}, got {kv.start}",
                                   param="kv")
            prefix = bm.cached_prefix_blocks(seq)[: kv.start // bm.block_size]
            if len(prefix) * bm.block_size < kv.start:
                bm.release_reserved(list(kv.block_ids))
                self.kv_prefix_misses += 1
                return
        bm.adopt(seq, list(kv.block_ids), kv.num_tokens, prefix)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its KV unless it is held for export."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason is FinishReason.ABORT:
            self._prompt_logprobs.pop(seq.key, None)
        if seq.session is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.session_pins.pin(seq.session, seq, self.clock())  # the next round starts from here
        if not seq.keep_kv:
            self.release(seq.key)

    def abort(self, key: StageKey) -> bool:
        """Drop a stage and free its KV at once (kept KV too); False if it is unknown."""
        seq = self.sequences.get(key)
        if seq is None:
            return False
        if not seq.is_finished:
            self.finish(seq, FinishReason.ABORT)
        self.release(key)
        return True

    def release(self, key: StageKey) -> None:
        """Forget a finished stage and free its blocks (the KV a push or pull was reading).

        An unfinished stage under the key is a later attempt of the same stage (a retry let in
        once the earlier one finished): a late release of the earlier attempt leaves it alone."""
        seq = self.sequences.get(key)
        if seq is not None and seq.is_finished:
            del self.sequences[key]
            self.block_manager.free(seq)

    def release_session(self, session_id: str) -> bool:
        """The session closed or moved away: unpin its history; whether it was pinned here."""
        return self.session_pins.release(session_id)

    def keys_of(self, request_id: str) -> list[StageKey]:
        """Every stage of a request held here, in flight or finished with kept KV."""
        return [key for key in self.sequences if key.request_id == request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- KV held for transfers -----------------------------------------------------------
    def reserve_kv(self, num_tokens: int) -> list[int]:
        """Blocks for `num_tokens` tokens of KV another worker will write (Worker.PrepareKv)."""
        bm = self.block_manager
        n = bm.blocks_for_tokens(num_tokens)
        if n > bm.num_free_blocks and not self.session_pins.evict_lru(n):
            raise KvCapacityError(f"need {n} free KV blocks for {num_tokens} tokens, have {bm.num_free_blocks}")
        return bm.reserve(n)

    def release_reserved(self, block_ids: list[int]) -> None:
        self.block_manager.release_reserved(block_ids)

    def lease_session_kv(self, session_id: str, max_tokens: int) -> list[int]:
        """Hold the whole blocks of a pinned session history's first `max_tokens` tokens for
        another worker's lazy pull (AMPD §3: a remote incremental prefill reads the history
        from the decode worker). One more reference each, so that neither eviction nor expiry
        of the pin can hand the blocks out while they are read; `release_lease` gives it back.
        Empty when the session holds nothing here."""
        blocks = self.session_pins.blocks_of(session_id)[: max(0, max_tokens) // self.block_manager.block_size]
        self.block_manager.retain(blocks)
        return blocks

    def release_lease(self, block_ids: list[int]) -> None:
        self.block_manager.release_blocks(block_ids)

    def hold_cached_prefix(self, token_ids: list[int] | tuple[int, ...], max_tokens: int) -> list[int]:
        """The blocks of this worker's prefix cache holding the longest cached prefix of
        `token_ids` (whole blocks, at most `max_tokens`), one more reference each so they stay
        until the stage that uses them is added; `release_lease` gives it back. A remote
        incremental prefill pulls only the history after them (AMPD: the prefill worker often
        computed most of the history itself, in the session's earlier rounds)."""
        bm = self.block_manager
        probe = Sequence(StageKey("", 0), list(token_ids), len(token_ids), SamplingParams(), 0, 0.0)
        blocks = bm.cached_prefix_blocks(probe)[: max(0, max_tokens) // bm.block_size]
        bm.retain(blocks)
        if probe.block_hashes:
            self._leased_prompts.append((probe.token_ids, probe.block_hashes))
        return blocks

    def _seed_from_leased_prompts(self, seq: Sequence) -> None:
        """A new stage whose prompt a lease hashed takes those hashes (and the lease's entry goes)."""
        leased = self._leased_prompts
        for i, (tokens, hashes) in enumerate(leased):
            if self.block_manager.seed_block_hashes(seq, tokens, hashes):
                del leased[i]
                return

    def kv_blocks(self, key: StageKey) -> tuple[list[int], int]:
        """A stage's block table and how many tokens of it hold computed KV."""
        seq = self.sequences.get(key)
        if seq is None:
            raise KeyError(f"stage {key} is not in the engine")
        return list(seq.block_table), seq.num_computed_tokens

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step, as the batch policy builds it (see `splitserve.core.policy`)."""
        now = self.clock()
        self.session_pins.expire(now)
        step = _Step(self)
        self.kv_short = False
        self.policy.next_batch(step, now)
        if step.preempted:
            self.kv_short = True
        return SchedulerOutput.of(step.entries, step.preempted, step.held_until)

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[StageKey, int], latency_s: float,
                           logprobs: Mapping[StageKey, TokenLogprobs] | None = None,
                           prompt_logprobs: Mapping[StageKey, tuple[int, list[TokenLogprobs]]] | None = None,
                           ) -> list[TokenEvent]:
        """Apply an executed step: KV computed, tokens appended, stages finished; their events.
        `logprobs`: the sampled tokens' logprobs of the stages whose requests asked for them;
        `prompt_logprobs`: (first position, logprobs) of the prompt tokens this step scored, for
        the stages that asked: kept until the stage's next event, which carries them."""
        events: list[TokenEvent] = []
        for key, (start, records) in (prompt_logprobs or {}).items():
            pending = self._prompt_logprobs.get(key)
            if pending is not None and pending[0] + len(pending[1]) == start:
                pending[1].extend(records)  # the next chunk of the same prefill
            else:
                self._prompt_logprobs[key] = (start, list(records))
        sequences, bm = self.sequences, self.block_manager
        for e in out.entries:
            seq = e.seq
            if sequences.get(seq.key) is not seq:
                continue  # aborted while the step ran
            seq.num_computed_tokens = e.start + e.num_new_tokens
            bm.commit_computed(seq)
            token = sampled.get(seq.key)
            if token is not None:
                events.append(self._append_token(seq, token, logprobs.get(seq.key) if logprobs else None))
            elif seq.reached_stage_end:  # a prefill-only stage: KV done, nothing sampled
                self.finish(seq, FinishReason.STAGE_END)
                events.append(TokenEvent(seq.key, [], "", FinishReason.STAGE_END.value, seq.prompt_len,
                                         seq.num_output_tokens, _queue_wait(seq)))
            else:
                continue
            scored = self._prompt_logprobs.pop(seq.key, None)
            if scored is not None:
                events[-1].prompt_logprobs_start, events[-1].prompt_logprobs = scored
        self.policy.observe(ExecutedBatch(out.shape, latency_s))
        return events

    # ---- load -------------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        """This scheduler's load figures (the worker adds its identity, role and draining)."""
        bm = self.block_manager
        queued = 0
        for s in self.waiting:
            queued += len(s.token_ids) - s.num_computed_tokens
        for s in self.running:
            uncomputed = len(s.token_ids) - s.num_computed_tokens
            if uncomputed > 1:  # still in prefill (prompt or recompute)
                queued += uncomputed
        queries = bm.prefix_queries_tokens
        boundary = getattr(self.policy, "length_boundary", None)  # LAPS' L_m, when the policy has one
        l_m = boundary.tokens(0) if boundary is not None else 0.0
        return WorkerLoad(
            free_blocks=bm.num_free_blocks, total_blocks=bm.num_blocks, block_size=bm.block_size,
            running=len(self.running), waiting=len(self.waiting), queued_prefill_tokens=queued,
            num_preemptions=self.num_preemptions,
            prefix_hit_rate=bm.prefix_hits_tokens / queries if queries else 0.0,
            prefix_hit_tokens=bm.prefix_hits_tokens, pinned_sessions=len(self.session_pins),
            pinned_blocks=self.session_pins.num_pinned_blocks, session_history_lost=self.session_pins.history_lost,
            length_boundary=l_m if math.isfinite(l_m) else -1.0,
        )

    def prefill_queue(self) -> list[PrefillTask]:
        """Stages still prefilling, running ones first: (task, l_hist, l_incr, enqueue time)."""
        prefilling = [s for s in self.running if s.in_prefill] + list(self.waiting)
        return [PrefillTask(str(s.key), s.num_computed_tokens, s.num_uncomputed_tokens, s.arrival_time)
                for s in prefilling]

    # ---- internals ----------------------------------------------------------------------------
    def _validate(self, prompt: list[int], outputs: list[int], spec: StageSpec, text: OutputText | None) -> None:
        cfg, params = self.config, spec.sampling
        vocab = cfg.vocab_size
        if not prompt:
            raise InvalidInput("prompt must contain at least 1 token", param="prompt")
        if vocab is not None:
            for name, ids in (("prompt", prompt), ("output_token_ids", outputs)):
                bad = _first_token_outside(ids, vocab)
                if bad is not None:
                    raise InvalidInput(f"{name} token id {ids[bad]!r} at index {bad} is outside the vocabulary "
                                       f"[0, {vocab})", param=name)
        params.validate(vocab if vocab is not None else 1 << 63)
        if params.stop and text is None:
            raise InvalidInput("stop strings need a tokenizer; the model directory has none (use stop_token_ids)",
                               param="stop")
        total = len(prompt) + params.max_tokens
        if total > cfg.max_model_len:
            raise InvalidInput(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                               f"exceeds max_model_len ({cfg.max_model_len})", param="prompt")
        if len(outputs) >= params.max_tokens:
            raise InvalidInput(f"output_token_ids ({len(outputs)}) must be fewer than max_tokens ({params.max_tokens})",
                               param="output_token_ids")
        if total > self.kv_capacity_tokens:
            raise InvalidInput(f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity "
                               f"({self.kv_capacity_tokens} tokens)", param="prompt")
        known, supplied = len(prompt) + len(outputs), spec.kv_tokens
        if spec.kv is not None and not 0 < supplied < known:
            raise InvalidInput(f"kv covers {supplied} tokens; it must cover 1..{known - 1} of the {known} known "
                               "tokens", param="kv")
        if spec.end is not None and spec.end < total and spec.end <= supplied:
            raise InvalidInput(f"end ({spec.end}) must be beyond the supplied KV ({supplied} tokens)", param="end")

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> TokenEvent:
        seq.token_ids.append(token)
        params = seq.params
        reason = None
        if not params.ignore_eos and token in self.config.eos_token_ids:
            reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif len(seq.token_ids) - seq.prompt_len >= params.max_tokens:
            reason = FinishReason.LENGTH
        elif seq.reached_stage_end:
            reason = FinishReason.STAGE_END
        if seq.constraint is not None and reason is not FinishReason.STOP:
            # The grammar's end (its EOS accepted, with ignore_eos too) ends the output: nothing
            # may follow it. A token it refuses cannot be sampled (the logits were masked).
            if not seq.constraint.accept(token) or seq.constraint.terminated:
                reason = FinishReason.STOP
        text = ""
        if seq.text is not None:
            text = seq.text.push([token], final=reason is not None)
            if seq.text.stopped:
                reason = FinishReason.STOP
        if reason is not None:
            self.finish(seq, reason)
        return TokenEvent(seq.key, [token], text, reason.value if reason else None, seq.prompt_len,
                          seq.num_output_tokens, _queue_wait(seq), [logprobs] if logprobs is not None else [])

    def _admit(self, seq: Sequence, wanted: int) -> int | None:
        """Move a waiting sequence to running with blocks for its next tokens (at most `wanted`);
        how many it computes this step, or None when the blocks are not there."""
        bm = self.block_manager
        may_drop = not self.running  # nothing running: no step will free a block
        if seq.block_table:  # its KV is in place (from another worker): only grow it
            need = bm.blocks_to_grow(seq, wanted)
            if need > bm.num_free_blocks and not self.session_pins.evict_lru(need, _session_of(seq)) and \
                    not (may_drop and self._drop_waiting_kv(need, keep=seq)):
                return None
            bm.grow(seq, wanted)
            n = wanted
        else:
            hits, n = self._admission(seq, wanted)
            need = bm.admission_cost(seq, hits, n)
            if need > bm.num_free_blocks:
                # Idle sessions' pinned history goes before anything else waiting or running.
                if not self.session_pins.evict_lru(need, _session_of(seq)) and not (may_drop and self._drop_waiting_kv(need)):
                    return None
                hits, n = self._admission(seq, wanted)  # dropped KV may be cached hits now
                if bm.admission_cost(seq, hits, n) > bm.num_free_blocks:
                    return None
            bm.admit(seq, hits, n)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.admitted_time is None:
            seq.admitted_time = self.clock()
        return n

    def _admission(self, seq: Sequence, wanted: int) -> tuple[list[int], int]:
        """Cached prefix blocks and new tokens (at most `wanted`) to admit a sequence without blocks."""
        bm = self.block_manager
        # Looked up at admission: growing running sequences may have evicted cached blocks.
        hits = bm.cached_prefix_blocks(seq)
        return hits, min(wanted, seq.end - len(hits) * bm.block_size)

    def _make_room(self, seq: Sequence, n: int, scheduled: set[StageKey], preempted: list[Sequence]) -> bool:
        """Preempt the newest running sequences not in this step until `seq` can grow by n."""
        bm = self.block_manager
        if not bm.can_grow(seq, n):
            self.session_pins.evict_lru(bm.blocks_to_grow(seq, n), _session_of(seq))  # idle histories before running requests
        while not bm.can_grow(seq, n):
            victim = self._preemption_victim(seq, scheduled)
            if victim is seq:  # priority: everything it could displace outranks it
                self._preempt(seq)
                preempted.append(seq)
                return False
            if victim is None:
                # Alone and preempting itself, it would come back to the same wall (a livelock)
                # while waiting stages' KV holds the blocks it needs.
                if len(self.running) == 1 and self._drop_waiting_kv(bm.blocks_to_grow(seq, n)):
                    return True
                self._preempt(seq)
                preempted.append(seq)
                return False
            self._preempt(victim)
            preempted.append(victim)
        return True

    def _preemption_victim(self, seq: Sequence, scheduled: set[StageKey]) -> Sequence | None:
        """Whom `seq` displaces to grow: a running sequence not in this step, the newest (fcfs)
        or the one with the largest (priority, arrival) (priority: `seq` itself when its own key
        is larger still, as vLLM preempts the lowest-priority request even when that is the one
        growing); None when there is no one."""
        candidates = (s for s in reversed(self.running) if s is not seq and s.key not in scheduled)
        if not self.priority_order:
            return next(candidates, None)
        victim = max(candidates, key=priority_key, default=None)
        if victim is not None and priority_key(seq) > priority_key(victim):
            return seq
        return victim

    def _drop_waiting_kv(self, need: int, keep: Sequence | None = None) -> bool:
        """Drop the KV waiting stages hold (newest first, never `keep`'s) until `need` blocks are
        free; whether they are. Nothing is dropped when even all of it would not be enough
        (the rest held by reservations or KV kept for export): that would only waste it.

        Only where no step would ever free a block otherwise; the dropped stages recompute.
        """
        bm = self.block_manager
        if bm.num_free_blocks >= need:
            return True
        holders = [s for s in reversed(self.waiting) if s is not keep and s.block_table]
        if self.priority_order:  # the lowest-priority stages' KV goes first
            holders.sort(key=priority_key, reverse=True)
        references = Counter(b for s in holders for b in s.block_table)
        held = list(references)
        freeable = sum(ref == references[b] for b, ref in zip(held, bm.ref_counts(held)))
        if bm.num_free_blocks + freeable < need:
            return False
        for other in holders:
            if bm.num_free_blocks >= need:
                break
            bm.free(other)
            other.num_preemptions += 1
            self.num_preemptions += 1
        return bm.num_free_blocks >= need

    def _preempt(self, seq: Sequence) -> None:
        # Recompute-style preemption: KV is dropped (cached full blocks may still be hit
        # on re-admission) and the sequence re-enters at the head of the waiting queue.
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


class _Step:
    """The `StepBuilder` of one `Scheduler.schedule` call: each `add` takes effect at once."""

    __slots__ = ("_scheduler", "running", "waiting", "budget", "entries", "preempted", "held_until",
                 "_waiting_views", "_scheduled", "_tokens_left")

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        bm = scheduler.block_manager
        self.budget = budget = scheduler.budget
        self.running = [_view(s, s.num_computed_tokens) for s in scheduler.running]
        waiting = []
        if scheduler.priority_order:  # the best max_num_seqs by (priority, arrival); ties keep queue order
            head = heapq.nsmallest(budget.max_num_seqs, scheduler.waiting, key=priority_key)
        else:
            head = islice(scheduler.waiting, budget.max_num_seqs)
        for s in head:
            # A waiting sequence holding blocks got its KV from another worker: no lookup.
            computed = s.num_computed_tokens if s.block_table else bm.cached_prefix_hint_tokens(s)
            waiting.append(_view(s, computed))
        self.waiting = waiting
        self._waiting_views = {v.key: v for v in waiting}
        self.entries: list[ScheduledEntry] = []
        self.preempted: list[Sequence] = []
        self.held_until: float | None = None
        self._scheduled: set[StageKey] = set()
        self._tokens_left = budget.max_num_batched_tokens

    @property
    def tokens_left(self) -> int:
        return self._tokens_left

    @property
    def seqs_left(self) -> int:
        return self.budget.max_num_seqs - len(self._scheduler.running)

    @property
    def preempted_any(self) -> bool:
        return bool(self.preempted)

    @property
    def kv_free_fraction(self) -> float:
        bm = self._scheduler.block_manager
        return bm.num_free_blocks / bm.num_blocks if bm.num_blocks else 1.0

    @property
    def kv_reclaimable_fraction(self) -> float:
        bm, pins = self._scheduler.block_manager, self._scheduler.session_pins
        if not bm.num_blocks or not pins.num_pinned_blocks:
            return 0.0
        # Only blocks no running request shares with the pin come free when it goes.
        return bm.freeable_if_released(pins.block_ids()) / bm.num_blocks

    def add(self, key: StageKey, num_tokens: int) -> int:
        scheduler = self._scheduler
        seq = scheduler.sequences.get(key)
        if key in self._scheduled:
            raise PolicyContractError(f"stage {key} is already in this step")
        if seq is not None and seq in self.preempted:
            return 0  # preempted earlier in this step (a running request's victim)
        if seq is not None and seq.status is SequenceStatus.RUNNING:
            remaining = seq.num_schedulable_tokens  # as its view shows: nothing changed it since
        else:
            view = self._waiting_views.get(key)
            if view is None:
                raise PolicyContractError(f"stage {key} is not in this step's queues")
            remaining = view.num_remaining_tokens
        if not 1 <= num_tokens <= remaining:
            raise PolicyContractError(f"stage {key}: num_tokens must be in [1, {remaining}], got {num_tokens}")
        if num_tokens > self._tokens_left:
            raise PolicyContractError(f"stage {key}: {num_tokens} tokens exceed the {self._tokens_left} left "
                                      f"in this step's budget")
        if seq.status is SequenceStatus.RUNNING:
            if not scheduler._make_room(seq, num_tokens, self._scheduled, self.preempted):
                scheduler.kv_short = True
                return 0
            scheduler.block_manager.grow(seq, num_tokens)
        else:
            if self.seqs_left <= 0:
                raise PolicyContractError(f"stage {key}: admitting it exceeds max_num_seqs "
                                          f"({self.budget.max_num_seqs})")
            if self.preempted:
                scheduler.kv_short = True
                return 0  # memory is short this step: admitting now would only thrash
            admitted = scheduler._admit(seq, num_tokens)
            if admitted is None:
                scheduler.kv_short = True
                return 0
            num_tokens = admitted
        self.entries.append(ScheduledEntry(seq, seq.num_computed_tokens, num_tokens))
        self._scheduled.add(key)
        self._tokens_left -= num_tokens
        return num_tokens

    def preempt(self, key: StageKey) -> None:
        seq = self._scheduler.sequences.get(key)
        if seq is None or seq.status is not SequenceStatus.RUNNING or key in self._scheduled:
            raise PolicyContractError(f"stage {key}: only a running stage not in this step can be preempted")
        self._scheduler._preempt(seq)
        self.preempted.append(seq)

    def hold_until(self, t: float) -> None:
        self.held_until = t if self.held_until is None else min(self.held_until, t)


def _first_token_outside(ids: list[int], vocab: int) -> int | None:
    """Index of the first id that is not an int in [0, vocab), else None (checked in C first:
    prompts run to tens of thousands of tokens)."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab):
        return None
    return next(i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < vocab)


def _session_of(seq: Sequence) -> str | None:
    return seq.session.session_id if seq.session is not None else None


def _view(seq: Sequence, num_computed_tokens: int) -> QueuedRequest:
    return QueuedRequest(seq.key, seq.arrival_time, seq.prompt_len, seq.end, num_computed_tokens, seq.priority,
                         seq.ttft_deadline, seq.itl_slo_s, seq.num_preemptions)


def _queue_wait(seq: Sequence) -> float | None:
    return None if seq.admitted_time is None else max(0.0, seq.admitted_time - seq.arrival_time)
