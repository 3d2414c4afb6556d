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
from splitserve.state_records import WorkerLoad


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
        every sequence's computed blocks to the prefix cache (entry order). Between steps
        where a sequence needs a new block, fills one, or an allocation evicts a cached
        block that may free a hash a sequence's block waits for, those do nothing, so only
        such steps are replayed, in order: the same blocks, taken and indexed in the same
        order as stepping. `latencies_s[i]` is step i's time, for `policy.observe`.
        """
        if self.applied or not 0 <= done < self.steps:
            raise ValueError(f"apply once, with done in [0, {self.steps}); applied {self.applied}, done {done}")
        self.applied = done
        if done == 0:
            return
        scheduler, bm = self.scheduler, self.scheduler.block_manager
        bs = bm.block_size
        entries = self.out.entries
        tokens = [self.token_id] * done
        for e in entries:
            e.seq.token_ids += tokens  # hashes of blocks not yet computed are never indexed early
        # Step i's schedule grows a sequence when its new token starts a block (step 0's was
        # grown when scheduled); step i's update fills a block when its KV ends one.
        grows: dict[int, list[int]] = {}
        fills: dict[int, list[int]] = {}
        for index, e in enumerate(entries):
            first_grow = (-e.start) % bs or bs
            for i in range(first_grow, done, bs):
                grows.setdefault(i, []).append(index)
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
        for e in entries:
            e.seq.num_computed_tokens = e.start + done
        policy = scheduler.policy
        if getattr(policy, "observes_steps", True):
            batch = len(entries)
            for i in range(done):
                shape = StepShape((), batch, self.first_context_tokens + i * batch)
                policy.observe(ExecutedBatch(shape, float(latencies_s[i])))

    def load_at_step(self, scheduled: int) -> WorkerLoad:
        """The scheduler's load once the run's first `scheduled` steps hold their blocks
        (without applying them: only the blocks move; running and waiting stay as they are)."""
        bm = self.scheduler.block_manager
        extra = 0
        for e in self.out.entries:
            extra += max(0, bm.blocks_for_tokens(e.start + scheduled) - len(e.seq.block_table))
        load = self.scheduler.load()
        return dataclasses.replace(load, free_blocks=load.free_blocks - extra)
