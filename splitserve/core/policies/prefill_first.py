"""Prefill-first: waiting prefills are admitted before running decodes get their tokens
(vLLM v0's default scheduler, SGLang's prefill-priority scheduling); the colocated
baseline opposite fcfs, which serves decodes first (vLLM v1, Sarathi-style chunking).

Each step:

1. **Prefills**: the unfinished prefill chunks of running requests (oldest first), then the
   waiting queue in order (preempted requests first), each `min(remaining, tokens left)`;
   a waiting request that finds no KV memory stops admission, so nobody overtakes it
   (first come, first served, as fcfs).
2. **Decodes**: every running decode, one token each, but only in a step that holds no
   prefill (`mixed=False`, the default: a step is prefill-only or decode-only, as vLLM v0
   without chunked prefill and SGLang without `--enable-mixed-chunk` run them; the
   prefills are still chunked at the step's token budget). With `mixed=True` the decodes
   take whatever budget the prefills left in the same step.

**No decode waits forever.** After `max_decode_stall` steps in a row (default 8) that
left a running decode without its token, the next step is decode-first: every running
decode gets its token, then the prefills take the rest of the budget. A decode therefore
waits at most `max_decode_stall` steps between two of its tokens, however many prefills
keep arriving, wherever the step's token budget holds every running request
(`max_num_batched_tokens >= max_num_seqs`, as in every real configuration; below that,
decodes beyond the budget wait under fcfs too). vLLM v0 and SGLang bound the stall only by
KV memory (admission stops when it is full).

`steady_decodes = True`: with only decodes running and nothing admissible, step 1 adds
nothing, so step 2 adds every running decode with one token whatever the time (and
resets the stall count), which is what a fast-forwarded decode run assumes.
"""

from __future__ import annotations

from splitserve.core.policies.options import flag_option, number_option
from splitserve.core.policy import ExecutedBatch, QueuedRequest, StepBuilder

__all__ = ["PrefillFirstPolicy"]


class PrefillFirstPolicy:
    """Prefills (running chunks, then the waiting queue) before decodes; decodes only in
    steps without prefill unless `mixed`; decodes first after `max_decode_stall` stalls."""

    name = "prefill_first"
    observes_steps = False  # observe() below is a no-op
    steady_decodes = True  # decodes only, nothing admissible: every running request, one token

    def __init__(self, mixed: bool | str = False, max_decode_stall: int | str = 8):
        self.mixed: bool = flag_option("mixed", mixed)
        self.max_decode_stall: int = number_option("max_decode_stall", max_decode_stall, minimum=1, integer=True)
        self.stalled = 0  # steps in a row that left a running decode without its token

    def next_batch(self, step: StepBuilder, now: float) -> None:
        decodes = [req for req in step.running if req.is_decode]
        if self.stalled >= self.max_decode_stall:  # the decodes have waited long enough: they go first
            self._decodes(step, decodes)
            self._prefills(step)
            self.stalled = 0
            return
        prefilled = self._prefills(step)
        if decodes and prefilled and not self.mixed:
            self.stalled += 1  # a prefill-only step
            return
        self.stalled = 0 if self._decodes(step, decodes) else self.stalled + 1

    @staticmethod
    def _prefills(step: StepBuilder) -> bool:
        """Unfinished prefill chunks, then the waiting queue as fcfs admits it; whether any ran."""
        added = False
        for req in step.running:
            if not req.is_decode and step.tokens_left > 0:
                added |= step.add(req.key, min(req.num_remaining_tokens, step.tokens_left)) > 0  # 0: preempted
        for req in step.waiting:  # queue order: preempted requests are at the front
            if step.tokens_left == 0 or step.seqs_left == 0 or step.preempted_any:
                break
            if not step.add(req.key, min(req.num_remaining_tokens, step.tokens_left)):
                break  # no KV memory for the head: nobody overtakes it
            added = True
        return added

    @staticmethod
    def _decodes(step: StepBuilder, decodes: list[QueuedRequest]) -> bool:
        """One token for every running decode while the budget lasts; whether each had its turn."""
        for req in decodes:
            if step.tokens_left == 0:
                return False
            step.add(req.key, 1)  # 0: preempted for memory, it waits in the queue now
        return True

    def observe(self, executed: ExecutedBatch) -> None:
        pass
