"""First-come-first-served with one token budget and chunked prefill (the baseline)."""

from __future__ import annotations

from typing import Sequence

from workers.policies.base import Batch, BatchEntry, ExecutedBatch, QueuedRequest, StepBudget


class FcfsPolicy:
    """Running requests first (decodes and unfinished prefill chunks), then waiting ones."""

    name = "fcfs"
    observes_steps = False  # observe() below is a no-op

    def next_batch(
        self,
        running: Sequence[QueuedRequest],
        waiting: Sequence[QueuedRequest],
        budget: StepBudget,
        now: float,
    ) -> Batch:
        tokens_left = budget.max_num_batched_tokens
        entries: list[BatchEntry] = []
        for req in running:
            if tokens_left == 0:
                break
            n = min(req.num_remaining_tokens, tokens_left)
            entries.append(BatchEntry(req.request_id, n))
            tokens_left -= n
        num_seqs = len(running)
        for req in waiting:  # queue order: preempted requests are at the front
            if tokens_left == 0 or num_seqs >= budget.max_num_seqs:
                break
            n = min(req.num_remaining_tokens, tokens_left)
            entries.append(BatchEntry(req.request_id, n))
            tokens_left -= n
            num_seqs += 1
        return Batch(entries)

    def observe(self, executed: ExecutedBatch) -> None:
        pass
