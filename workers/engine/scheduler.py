"""Step scheduler: one token budget for prefill and decode, chunked prefill, preemption.

The *choice* of work is the BatchPolicy's; the scheduler owns the queues and KV memory
and turns the policy's choice into a feasible step (pure: no torch, clock injected).

Every new sequence waits, including one whose KV arrived from another worker (a later
stage: its blocks are already in its table). Such a sequence is admitted, as any other,
only under `max_num_seqs`, so a decode worker fed by prefill workers never runs a larger
batch than it was configured for; it waits holding its KV, which it computes no more.
That held KV is the one memory no step frees, so where it would stop all progress (nothing
else running, or the only running sequence about to preempt itself) it is dropped, newest
first, and those stages recompute (`_drop_waiting_kv`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from workers.policies.base import BatchPolicy, ExecutedBatch, QueuedRequest, StepBudget


@dataclass
class ScheduledEntry:
    """One sequence's share of a step: tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step produces the sequence's next token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    entries: list[ScheduledEntry] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)


class Scheduler:
    """Owns the waiting and running queues and decides each step's batch."""

    def __init__(
        self,
        block_manager: BlockManager,
        policy: BatchPolicy,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        clock: Callable[[], float],
    ):
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {max_num_batched_tokens}")
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {max_num_seqs}")
        self.block_manager = block_manager
        self.policy = policy
        self.budget = StepBudget(max_num_batched_tokens, max_num_seqs)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.sequences:
            raise ValueError(f"request_id {seq.request_id!r} is already in the engine")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"request {seq.request_id!r} must be added waiting, not {seq.status.value}")
        self.sequences[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its KV unless it is held for export."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if not seq.keep_kv:
            self.release(seq.request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished sequence and free its blocks."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Ask the policy for a batch and make it fit in KV memory."""
        bm = self.block_manager
        lookahead = list(self.waiting)[: self.budget.max_num_seqs]
        # A waiting sequence holding blocks got its KV from another worker: no lookup.
        prefix_hits = {s.request_id: bm.cached_prefix_blocks(s) for s in lookahead if not s.block_table}
        running_view = [_view(s, s.num_computed_tokens) for s in self.running]
        waiting_view = [
            _view(s, s.num_computed_tokens if s.block_table else len(prefix_hits[s.request_id]) * bm.block_size)
            for s in lookahead
        ]
        batch = self.policy.next_batch(running_view, waiting_view, self.budget, self.clock())

        out = SchedulerOutput()
        scheduled: set[str] = set()
        tokens_left = self.budget.max_num_batched_tokens
        admit_waiting = True
        for entry in batch.entries:
            seq = self.sequences.get(entry.request_id)
            if seq is None or entry.request_id in scheduled or seq in out.preempted:
                continue
            n = min(entry.num_tokens, seq.num_schedulable_tokens, tokens_left)
            if n <= 0:
                continue
            if seq.status is SequenceStatus.RUNNING:
                if not self._make_room(seq, n, scheduled, out.preempted):
                    admit_waiting = False
                    continue
                bm.grow(seq, n)
            elif seq.status is SequenceStatus.WAITING:
                if not admit_waiting or out.preempted or len(self.running) >= self.budget.max_num_seqs:
                    continue
                admitted = self._admit(seq, n)
                if admitted is None:
                    admit_waiting = False  # FCFS: no one overtakes a blocked head
                    continue
                n = admitted
            else:
                continue
            out.entries.append(ScheduledEntry(seq, seq.num_computed_tokens, n))
            scheduled.add(seq.request_id)
            tokens_left -= n
        return out

    def on_step_done(self, out: SchedulerOutput, latency_s: float) -> None:
        """Advance computed counts, index newly full blocks, feed the policy."""
        prefill_tokens = decode_seqs = max_ctx = 0
        for e in out.entries:
            if e.seq.request_id not in self.sequences:
                continue  # aborted while the step ran
            e.seq.num_computed_tokens = e.start + e.num_new_tokens
            self.block_manager.commit_computed(e.seq)
            if e.num_new_tokens == 1 and e.start >= e.seq.prompt_len:
                decode_seqs += 1
            else:
                prefill_tokens += e.num_new_tokens
            max_ctx = max(max_ctx, e.seq.num_computed_tokens)
        self.policy.observe(ExecutedBatch(prefill_tokens, decode_seqs, max_ctx, latency_s))

    # ---- internals -------------------------------------------------------------
    def _admit(self, seq: Sequence, wanted: int) -> int | None:
        """Move a waiting sequence to running with blocks for its next tokens (at most `wanted`);
        how many it computes this step, or None when the blocks are not there."""
        bm = self.block_manager
        may_drop = not self.running  # nothing running: no step will free a block
        if seq.block_table:  # its KV is in place (from another worker): only grow it
            need = bm.blocks_to_grow(seq, wanted)
            if need > bm.num_free_blocks and not (may_drop and self._drop_waiting_kv(need, keep=seq)):
                return None
            bm.grow(seq, wanted)
            n = wanted
        else:
            hits, n = self._admission(seq, wanted)
            need = bm.admission_cost(seq, hits, n)
            if need > bm.num_free_blocks:
                if not (may_drop and self._drop_waiting_kv(need)):
                    return None
                hits, n = self._admission(seq, wanted)  # dropped KV may be cached hits now
                if bm.admission_cost(seq, hits, n) > bm.num_free_blocks:
                    return None
            bm.admit(seq, hits, n)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        return n

    def _admission(self, seq: Sequence, wanted: int) -> tuple[list[int], int]:
        """Cached prefix blocks and new tokens (at most `wanted`) to admit a sequence without blocks."""
        bm = self.block_manager
        # Looked up at admission: growing running sequences may have evicted cached blocks.
        hits = bm.cached_prefix_blocks(seq)
        cached = len(hits) * bm.block_size
        end = seq.num_tokens if seq.stop_at is None else min(seq.num_tokens, seq.stop_at)
        return hits, min(wanted, end - cached)

    def _make_room(self, seq: Sequence, n: int, scheduled: set[str], preempted: list[Sequence]) -> bool:
        """Preempt the newest unscheduled running sequences until `seq` can grow by n."""
        bm = self.block_manager
        while not bm.can_grow(seq, n):
            victim = next(
                (s for s in reversed(self.running) if s is not seq and s.request_id not in scheduled),
                None,
            )
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
        references = Counter(b for s in holders for b in s.block_table)
        freeable = sum(bm.blocks[b].ref_count == count for b, count in references.items())
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


def _view(seq: Sequence, num_computed_tokens: int) -> QueuedRequest:
    return QueuedRequest(
        request_id=seq.request_id,
        arrival_time=seq.arrival_time,
        prompt_len=seq.prompt_len,
        num_tokens=seq.num_tokens if seq.stop_at is None else min(seq.num_tokens, seq.stop_at),
        num_computed_tokens=num_computed_tokens,
    )
