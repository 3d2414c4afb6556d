"""Runs of identical decode steps, applied in bulk (the simulator's fast-forward).

Most steps of a long simulation are decode-only steps that repeat: every running
sequence gets one token and nothing can be admitted (no waiting request, or the running
set is full). With a policy that declares `steady_decodes` (its choice in that state is
exactly that, whatever the time), the first step of such a run is scheduled as usual,
and `DecodeRun.apply` then applies any number of the following steps at once with the
effect `Scheduler.schedule` + `update_from_output` have on them: KV grown, tokens
appended, computed counts, prefix-cache index (blocks taken and indexed in stepping's
order), `policy.observe` per step. The run ends
one step before the first sequence would finish; that last step the driver schedules
and updates for real, so finishing is never done here. `tests/unit/test_simulator.py`
checks that a fast-forwarded simulation equals one stepped one step at a time.

The run holds only while nothing outside changes the scheduler: a driver applies the
steps done so far (`apply`) before any stage is added, aborted or released, or KV is
reserved or freed, and then schedules the step in progress again (`Scheduler.schedule`
makes the same choice).
"""

from __future__ import annotations

import dataclasses

from splitserve.core.policy import ExecutedBatch
from splitserve.core.scheduler import Scheduler, SchedulerOutput
from splitserve.core.step_cost import StepShape
from splitserve.core.records import WorkerLoad


class DecodeRun:
    """`steps` identical decode-only steps, the first of which is `out` (already scheduled)."""

    __slots__ = ("scheduler", "out", "steps", "token_id", "applied")

    def __init__(self, scheduler: Scheduler, out: SchedulerOutput, steps: int, token_id: int):
        self.scheduler = scheduler
        self.out = out
        self.steps = steps
        self.token_id = token_id
        self.applied = 0

    @classmethod
    def find(cls, scheduler: Scheduler, out: SchedulerOutput, token_id: int) -> DecodeRun | None:
        """The run that starts with `out` if every step of it would sample `token_id`, else None.

        None unless: the policy is steady, `out` is decode-only with every running sequence
        in it and nothing preempted, nothing waiting could be admitted, no sequence would
        stop on `token_id` or match stop strings, and the blocks the whole run needs are
        free now.
        """
        if not getattr(scheduler.policy, "steady_decodes", False):
            return None
        if out.preempted or not out.shape.is_decode_only or len(out.entries) != len(scheduler.running):
            return None
        if scheduler.waiting and len(scheduler.running) < scheduler.budget.max_num_seqs:
            return None  # a waiting request is blocked only by memory, which a run never frees
        eos = scheduler.config.eos_token_ids
        steps = 1 << 62
        for e in out.entries:
            seq = e.seq
            params = seq.params
            if e.start + 1 != len(seq.token_ids):
                return None  # a 1-token recompute chunk past the prompt: it samples nothing
            if seq.text is not None or token_id in params.stop_token_ids or (
                    token_id in eos and not params.ignore_eos):
                return None
            steps = min(steps, params.max_tokens - (len(seq.token_ids) - seq.prompt_len))
            if seq.stop_at is not None:
                steps = min(steps, seq.stop_at - e.start)
        bm = scheduler.block_manager
        need = sum(bm.blocks_for_tokens(e.start + steps) - len(e.seq.block_table) for e in out.entries)
        return cls(scheduler, out, steps, token_id) if need <= bm.num_free_blocks else None

    @property
    def first_context_tokens(self) -> int:
        """Summed decode context of the run's first step."""
        return self.out.shape.decode_context_tokens

    def apply(self, done: int, latencies_s) -> None:
        """Apply the run's steps before `done` (done < steps: the last one runs for real), once.

        Stepping grows every sequence by one token per step (entry order) and then commits
        every sequence's computed blocks to the prefix cache (entry order). The result here
        is the same, block for block: the same blocks taken in the same order and indexed
        under the same hashes. `latencies_s[i]` is step i's time, for `policy.observe`.
        """
        if self.applied or not 0 <= done < self.steps:
            raise ValueError(f"apply once, with done in [0, {self.steps}); applied {self.applied}, done {done}")
        self.applied = done
        if done == 0:
            return
        entries = self.out.entries
        tokens = [self.token_id] * done
        for e in entries:
            e.seq.token_ids += tokens  # hashes of blocks not computed yet are never indexed early
        if not self._apply_in_bulk(done):
            self._replay(done)
        for e in entries:
            e.seq.num_computed_tokens = e.start + done
        policy = self.scheduler.policy
        if getattr(policy, "observes_steps", True):
            batch = len(entries)
            for i in range(done):
                shape = StepShape((), batch, self.first_context_tokens + i * batch)
                policy.observe(ExecutedBatch(shape, float(latencies_s[i])))

    def _grow_events(self, done: int) -> list[tuple[int, int]]:
        """(step, entry index) of every block the steps after the first take, in stepping's order:
        step i's schedule grows a sequence whose new token starts a block (step 0's was grown
        when it was scheduled)."""
        bs = self.scheduler.block_manager.block_size
        events = []
        for index, e in enumerate(self.out.entries):
            events += [(i, index) for i in range((-e.start) % bs or bs, done, bs)]
        events.sort()
        return events

    def _apply_in_bulk(self, done: int) -> bool:
        """Every block the steps take in one allocation, and each sequence's new full blocks
        indexed at once, where that cannot differ from stepping: no block waits for a hash's
        holder, and the blocks the run fills have hashes that no block holds, before or
        after an eviction, and that no two of them share. False (nothing done) otherwise."""
        bm = self.scheduler.block_manager
        bs = bm.block_size
        entries = self.out.entries
        if bm.enable_prefix_caching:  # without a prefix index no block is hashed or waits for a holder
            filled: list[int] = []
            for e in entries:
                seq = e.seq
                if seq.commit_state is not None and seq.commit_state[2]:
                    return False  # a block waits for its hash's holder to be evicted
                filled += bm.update_block_hashes(seq)[e.start // bs:(e.start + done) // bs]
            if len(set(filled)) != len(filled) or bm.indexes_any(filled):
                return False
        events = self._grow_events(done)
        taken = bm.reserve(len(events)) if events else []
        for block_id, (_, index) in zip(taken, events):
            entries[index].seq.block_table.append(block_id)
        for e in entries:
            e.seq.num_computed_tokens = e.start + done
            bm.commit_computed(e.seq)
        return True

    def _replay(self, done: int) -> None:
        """The steps where a sequence needs a block, fills one, or an allocation evicts a cached
        block whose hash a waiting block may take, one by one in stepping's order (between
        them stepping changes no block)."""
        bm = self.scheduler.block_manager
        bs = bm.block_size
        entries = self.out.entries
        grows: dict[int, list[int]] = {}
        for i, index in self._grow_events(done):
            grows.setdefault(i, []).append(index)
        fills: dict[int, list[int]] = {}
        for index, e in enumerate(entries):
            for i in range((-(e.start + 1)) % bs, done, bs):
                fills.setdefault(i, []).append(index)
        evictions = bm.num_evictions - 1  # step 0's schedule may have evicted: look at waiting blocks
        for i in sorted(grows.keys() | fills.keys() | {0}):
            for index in grows.get(i, ()):
                e = entries[index]
                e.seq.num_computed_tokens = e.start + i
                bm.grow(e.seq, 1)
            commit = set(fills.get(i, ()))
            if bm.num_evictions != evictions:  # a hash a block waits for may be free now
                evictions = bm.num_evictions
                commit.update(index for index, e in enumerate(entries)
                              if e.seq.commit_state is not None and e.seq.commit_state[2])
            for index in sorted(commit):
                e = entries[index]
                e.seq.num_computed_tokens = e.start + i + 1
                bm.commit_computed(e.seq)

    def load_at_step(self, scheduled: int) -> WorkerLoad:
        """The scheduler's load once the run's first `scheduled` steps hold their blocks
        (without applying them: only the blocks move; running and waiting stay as they are)."""
        bm = self.scheduler.block_manager
        extra = 0
        for e in self.out.entries:
            extra += max(0, bm.blocks_for_tokens(e.start + scheduled) - len(e.seq.block_table))
        load = self.scheduler.load()
        return dataclasses.replace(load, free_blocks=load.free_blocks - extra)
