"""First-come-first-served with one token budget and chunked prefill (the baseline).

"First come" is the scheduler's queue order: arrival, or `(priority, arrival)` when built with
`scheduling_policy="priority"` (vLLM's `--scheduling-policy priority`)."""

from __future__ import annotations

from splitserve.core.policy import FCFS, ExecutedBatch, StepBuilder


class FcfsPolicy:
    """Running requests first (decodes and unfinished prefill chunks), then waiting ones in
    queue order; a waiting request that does not fit in KV memory blocks the ones behind
    it, so none overtakes the head of the queue."""

    name = "fcfs"
    scheduling_policy = FCFS  # the scheduler's queue order; make_batch_policy(..., scheduling_policy=) sets it
    observes_steps = False  # observe() below is a no-op
    steady_decodes = True  # decodes only, nothing admissible: every running request, one token

    def next_batch(self, step: StepBuilder, now: float) -> None:
        for req in step.running:
            if step.tokens_left == 0:
                break
            step.add(req.key, min(req.num_remaining_tokens, step.tokens_left))  # 0: preempted, skip it
        for req in step.waiting:  # queue order: preempted requests are at the front
            if step.tokens_left == 0 or step.seqs_left == 0 or step.preempted_any:
                break
            if not step.add(req.key, min(req.num_remaining_tokens, step.tokens_left)):
                break  # no KV memory for the head: nobody overtakes it

    def observe(self, executed: ExecutedBatch) -> None:
        pass
