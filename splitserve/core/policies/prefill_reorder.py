"""AMPD's prefill reordering (§4.2, Algorithm 2): a small look-ahead window at the head of the
waiting queue, reordered to maximise the number of tasks that meet their TTFT objective.

Each step:

1. **Started work first**: every running request (decodes, one token; unfinished prefill
   chunks, as much as the budget allows), oldest first, exactly as under fcfs. Their
   remaining prefill time is the offset every waiting task queues behind.
2. **The window** W: the first `window` (w, default 3) waiting requests in queue order; under
   the priority scheduling policy only those of the head's priority (a reordering never puts
   a request before one of a better priority).
3. **The ordering** π* = argmax_π S_π over the permutations of W that postpone no capped
   task (Alg. 2 lines 2-6), where S_π counts the tasks of W with
   `now + C(π(k)) <= ttft_deadline`, C(π(k)) = offset + Σ_{j<=k} t_pre(π(j)) (Eq. 3-4;
   `now - T_enq + C <= TTFT_thres` is the same test, the deadline being arrival + objective).
   Permutations are tried in lexicographic order of queue position, so the queue order
   wins ties and is kept whenever reordering helps no one.
4. **Admission** in π* order, then the rest of the queue in order, each request
   `min(remaining, tokens left)`, first-come-first-served within that order: a request
   that finds no KV memory stops admission (nobody overtakes it in this step).

**Postponement cap** (Alg. 2 lines 3-4 and 7). A task is postponed when a task behind it in
the queue is admitted while it is not; its counter goes up by one per step in which that
happens. Once a task has been postponed `window` times, orderings that would put any task
behind it in the queue ahead of it are skipped, so no task waits for more than w
overtakes. (The paper counts postponements at every reordering; a batched engine reorders
every step while a long prefill runs, which would use the cap up without anyone
overtaking, so only an actual overtake counts.)

**t_pre** (the paper's performance model): `perf_model.prefill_time(l_hist, l_incr)` for the
request's remaining tokens over its computed history. Without a model the policy learns
seconds per prefill token from the executed steps (`observe`), starting at zero (then
every ordering predicts the same times and the queue order stands until a step is seen).

A task without a TTFT objective (no deadline on the request, no `ttft_slo_ms` option)
counts as meeting it, so it neither attracts nor resists reordering.

`steady_decodes = True`: with only decodes running and nothing admissible, step 1 adds every
running decode with one token whatever the time.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from splitserve.core.policies.options import number_option, perf_model_option
from splitserve.core.policy import FCFS, PRIORITY, ExecutedBatch, QueuedRequest, StepBuilder
from splitserve.core.sequence import StageKey
from splitserve.perf.model import PerfModel

__all__ = ["PrefillReorderPolicy", "best_ordering"]


def best_ordering(deadlines: list[float | None], durations: list[float], capped: list[bool], now: float,
                  offset: float = 0.0) -> tuple[tuple[int, ...], int]:
    """Algorithm 2 lines 1-6 over one window, as plain data: the ordering (indices into the
    window, queue order = 0, 1, ...) that meets the most deadlines, and that count.

    `deadlines[i]` (None: no objective, always met), `durations[i]` = t_pre, `capped[i]`:
    task i may not be overtaken by a task behind it. Ties go to the lexicographically first
    ordering, so the identity wins when reordering helps no one.
    """
    n = len(deadlines)
    best: tuple[int, ...] = tuple(range(n))
    best_met = -1
    for order in itertools.permutations(range(n)):
        if any(capped[task] and any(earlier > task for earlier in order[:pos]) for pos, task in enumerate(order)):
            continue
        finish, met = now + offset, 0
        for task in order:
            finish += durations[task]
            deadline = deadlines[task]
            if deadline is None or finish <= deadline:
                met += 1
        if met > best_met:
            best, best_met = order, met
            if met == n:
                break  # nothing beats all met; later orderings only lose the tie
    return best, best_met


class PrefillReorderPolicy:
    """Running work first, then the waiting queue's head window reordered to meet the most
    TTFT objectives, each task overtaken at most `window` times (AMPD Alg. 2)."""

    name = "prefill_reorder"
    scheduling_policy = FCFS  # the scheduler's queue order; make_batch_policy(..., scheduling_policy=) sets it
    observes_steps = True  # learns seconds per prefill token when it has no perf model
    steady_decodes = True  # decodes only, nothing admissible: every running request, one token

    def __init__(self, perf_model: PerfModel | dict | str | None = None, window: int | str = 3,
                 ttft_slo_ms: float | str | None = None, learning_rate: float | str = 0.2):
        self.window: int = number_option("window", window, minimum=1, maximum=7, integer=True)  # 7! = 5040 orderings
        ttft = number_option("ttft_slo_ms", ttft_slo_ms, minimum=0.0, allow_none=True)
        self.default_ttft_slo_s: float | None = ttft / 1000 if ttft else None
        self.learning_rate: float = number_option("learning_rate", learning_rate, minimum=1e-6, maximum=1.0)
        self.perf_model: PerfModel | None = perf_model_option(perf_model)
        self.seconds_per_prefill_token = 0.0  # learned from executed steps when there is no perf model
        self.postponements: dict[StageKey, int] = {}  # waiting task -> times it was overtaken

    def next_batch(self, step: StepBuilder, now: float) -> None:
        offset = 0.0
        for req in step.running:  # oldest first: started work is never reordered
            if step.tokens_left == 0:
                break
            remaining = req.num_remaining_tokens
            if not step.add(req.key, min(remaining, step.tokens_left)):
                continue  # preempted for memory
            if not req.is_decode:
                offset += self._prefill_s(req.num_computed_tokens, remaining)
        waiting = step.waiting
        if not waiting:
            self.postponements.clear()
            return
        window = list(waiting[:self.window])
        if self.scheduling_policy == PRIORITY:  # overtake only within the head's priority
            head_priority = window[0].priority
            window = list(itertools.takewhile(lambda r: r.priority == head_priority, window))
        order = self._ordering(window, now, offset)
        admission = [window[i] for i in order] + list(waiting[len(window):])
        admitted: set[StageKey] = set()
        for req in admission:
            if step.tokens_left == 0 or step.seqs_left == 0 or step.preempted_any:
                break
            if not step.add(req.key, min(req.num_remaining_tokens, step.tokens_left)):
                break  # no KV memory for it: nobody overtakes it in this step
            admitted.add(req.key)
        self._count_postponements(waiting, admitted)

    def _ordering(self, window: list[QueuedRequest], now: float, offset: float) -> tuple[int, ...]:
        if len(window) < 2:
            return tuple(range(len(window)))
        deadlines = [self._deadline(r) for r in window]
        if all(d is None for d in deadlines):
            return tuple(range(len(window)))
        durations = [self._prefill_s(r.num_computed_tokens, r.num_remaining_tokens) for r in window]
        capped = [self.postponements.get(r.key, 0) >= self.window for r in window]
        return best_ordering(deadlines, durations, capped, now, offset)[0]

    def _count_postponements(self, waiting: Sequence[QueuedRequest], admitted: set[StageKey]) -> None:
        """A task still waiting is postponed in this step when a task behind it was admitted."""
        previous, counts = self.postponements, {}
        overtaken = False
        for req in reversed(waiting):  # from the back: has anyone behind `req` been admitted?
            key = req.key
            if key in admitted:
                overtaken = True
                continue
            count = previous.get(key, 0) + (1 if overtaken else 0)
            if count:
                counts[key] = count
        self.postponements = counts  # tasks that left the queue drop out

    def _deadline(self, req: QueuedRequest) -> float | None:
        return req.deadline(self.default_ttft_slo_s)

    def _prefill_s(self, history: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        if self.perf_model is not None:
            return self.perf_model.prefill_time(history, tokens)
        return self.seconds_per_prefill_token * tokens

    def observe(self, executed: ExecutedBatch) -> None:
        if self.perf_model is not None:
            return
        tokens = executed.shape.num_tokens
        if executed.shape.num_prefill_tokens <= 0 or executed.latency_s <= 0:
            return
        sample = executed.latency_s / tokens
        if self.seconds_per_prefill_token == 0.0:
            self.seconds_per_prefill_token = sample
        else:
            self.seconds_per_prefill_token += self.learning_rate * (sample - self.seconds_per_prefill_token)
