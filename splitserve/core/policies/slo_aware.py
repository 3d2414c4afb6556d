"""DynaServe's local scheduler (§4.2, Algorithm 2): decodes first, then as much prefill as the
ITL objective leaves room for, by a profile table every executed step refines.

Each step:

1. **Decodes first** (Alg. 2 line 2): every running decode, one token each, oldest first.
   None is ever left out for the objective: a step without some decode would give it a
   gap of two steps, worse than any step with it. (Only the step's token budget can stop
   them, where `max_num_seqs` exceeds `max_num_batched_tokens`: the newest decodes then
   wait a step, as under fcfs.) **Hand-offs** go with them: a split request's next stage
   whose KV is in place and that has one token to go (`QueuedRequest.is_decode` while it
   is still waiting, or a cut just inside the prompt: its first token) is a decode whose gap
   began on the previous stage's worker; queued behind prefills it waited steps (in the
   simulator every DynaServe miss on the Azure traces was a gap > 100 ms at the hand-off).
   Taken ahead of the queue's head, even one blocked for memory: one token each.
2. **The target**: the tightest `itl_slo_s` among the decodes in the step, else the
   policy's `itl_slo_ms`, times `target_fraction` (room for the prediction's error and the
   driver's per-step overhead). No decode in the step: no token's gap depends on its
   length, so the whole step budget goes to prefill. No objective at all: the same, which
   is fcfs with its one token budget (decodes first).
3. **M = MaxPrefillAllowed(target, mean decode context, decode count)** from the
   `LatencyTable` (§4.2's profile table: (prefill tokens, context, decode count) ->
   latency). The chunks a budget of M would take are known (step 4's order), and so is
   the KV history they read; the cost of that history is taken from the target and M
   asked again, which can only lower it, so the step stays predicted within the target.
4. **Prefill in arrival order** up to M (Alg. 2 lines 3-8): unfinished prefill chunks of
   running requests first, then waiting requests in queue order, each `min(remaining, M)`
   tokens. First-come-first-served like fcfs: a waiting request that finds no KV memory
   (`add` returns 0) stops admission, nobody overtakes it.

**KV pressure** (opt-in, `kv_pressure_below` > 0). Filling every step to the objective
stretches each decode token to ~90% of the ITL objective, so a request holds its KV up to twice
as long as under fcfs with short chunks; when memory binds, that residency is what fills it.
Below `kv_pressure_below` of the blocks free, after the step's decodes, the target shrinks in
proportion to the free share, down to `kv_pressure_min_scale` (0.5) of it: decodes finish
sooner and admission slows until memory frees. Blocks only idle session pins hold count as
free (they go to other requests before any preemption). It was on (0.4) until 2026-11-29: on
the datasheet roofline it removed the preemptions of DynaServe on P2048/D512 (A100 ×
Qwen2.5-14B, 5–96 per probe at 2.8–4.2 req/s); on measured A100 timing with vLLM's cost it
costs capacity and buys none — DynaServe 3.13 → 3.49 req/s on P2048/D512 and 3.18 → 3.46 on
P219/D1467 with it off (14B; 32B P219/D1467 3.28 → 3.40), the same on the other workloads
(docs/benchmarks.md, "The KV-pressure rule"): the throttled admission queues prefill (TTFT
grows) where recomputing a few preempted requests is cheaper. Default 0: off.

**Starvation guard.** M is never below `min_prefill_tokens` (default 16, one block) while
prefill work is queued, even when the decodes alone leave no room. Without it a loaded
worker (decodes at or past the target) admits nothing until its decodes drain, so a
queued request's TTFT is unbounded, and a table whose prior is too pessimistic never sees
the mixed step that would correct it. One block of prefill costs a compute-bound step
about 16 tokens' worth of linear layers (2.7 ms for Qwen2.5-14B on an A100, 3% of a
100 ms objective; nothing when the step is memory-bound), which the default
`target_fraction` of 0.9 covers: while the decodes alone fit the objective, the floor eats
into the margin, not into the objective (past it, the objective is missed with or without
it). `min_prefill_tokens=0` is Algorithm 2 to the letter.

**The table.** Seeded from `perf_model` (the simulator's and the emulated worker's own
model, or `splitserve profile`'s fit for a real worker), otherwise from scratch
(optimistic: it starts at zero and every step raises it); `observe` refines it with every
executed step's shape and latency (see `latency_table`).

**steady_decodes = True**: with only decodes running and nothing admissible, step 1 adds
every running decode with one token and steps 3-4 find nothing to add; the choice does not
depend on the time or on the table, so the simulator may fast-forward such runs (it then
still calls `observe` for every step, in order, with the same latencies).

Options may be given as strings (CLI flags, environment variables, the simulator's
`batch_policy_options`): numbers as text, `perf_model` as a `PerfModel`, its `to_dict()`
or its JSON text.
"""

from __future__ import annotations

from splitserve.core.policies.latency_table import LatencyTable
from splitserve.core.policies.options import number_option, perf_model_option
from splitserve.core.policy import ExecutedBatch, QueuedRequest, StepBuilder
from splitserve.perf.model import PerfModel

__all__ = ["SloAwarePolicy"]


class SloAwarePolicy:
    """Decodes first, then prefill up to MaxPrefillAllowed under the ITL objective (DynaServe Alg. 2)."""

    name = "slo_aware"
    observes_steps = True  # every executed step refines the table
    steady_decodes = True  # decodes only, nothing admissible: every running decode, one token, always

    def __init__(self, perf_model: PerfModel | dict | str | None = None, itl_slo_ms: float | str | None = None,
                 target_fraction: float | str = 0.9, min_prefill_tokens: int | str = 16,
                 learning_rate: float | str = 0.2, kv_pressure_below: float | str = 0.0,
                 kv_pressure_min_scale: float | str = 0.5):
        self.kv_pressure_below: float = number_option("kv_pressure_below", kv_pressure_below, minimum=0.0,
                                                      maximum=1.0)
        self.kv_pressure_min_scale: float = number_option("kv_pressure_min_scale", kv_pressure_min_scale,
                                                          minimum=1e-3, maximum=1.0)
        itl = number_option("itl_slo_ms", itl_slo_ms, minimum=0.0, allow_none=True)
        self.default_itl_slo_s: float | None = itl / 1000 if itl else None
        self.target_fraction: float = number_option("target_fraction", target_fraction, minimum=1e-3, maximum=1.0)
        self.min_prefill_tokens: int = number_option("min_prefill_tokens", min_prefill_tokens, minimum=0, integer=True)
        rate = number_option("learning_rate", learning_rate, minimum=1e-6, maximum=1.0)
        self.table = LatencyTable(perf_model_option(perf_model), rate)
        self.last_prefill_budget: int | None = None  # M of the latest step (None: no objective); for inspection

    def next_batch(self, step: StepBuilder, now: float) -> None:
        decodes = context = 0
        slo: float | None = None
        prefills: list[QueuedRequest] = []
        add, left = step.add, step.tokens_left
        for r in step.running:  # oldest first
            computed = r.num_computed_tokens
            if r.num_tokens - computed != 1 or computed < r.prompt_len:  # not `r.is_decode`: per decode, inlined
                prefills.append(r)
            elif left and add(r.key, 1):  # 0: preempted for memory, not in the step
                left -= 1
                decodes += 1
                context += computed + 1
                itl = r.itl_slo_s
                if itl is not None and (slo is None or itl < slo):
                    slo = itl
        waiting = step.waiting[:step.seqs_left] if not step.preempted_any else []
        if waiting and left:
            # Hand-offs: a split request's next stage whose KV is in place and that has one token to
            # go is a decode whose gap (or, cut just inside the prompt, whose first token) began on
            # the previous stage's worker. Behind the queue's prefills it waited steps (every
            # DynaServe miss in the simulator was a gap > 100 ms at the hand-off): it goes with
            # the decodes, ahead of the queue's head (one token: it overtakes nobody for long).
            queued = []
            for r in waiting:
                if left and r.num_remaining_tokens == 1 and add(r.key, 1):
                    left -= 1
                    decodes += 1
                    context += r.num_computed_tokens + 1
                    itl = r.itl_slo_s
                    if itl is not None and (slo is None or itl < slo):
                        slo = itl
                else:
                    queued.append(r)
            waiting = queued
        if not left:
            return
        if not prefills and not waiting:
            return
        scale = 1.0
        if self.kv_pressure_below > 0:
            free = step.kv_free_fraction  # after the decodes and hand-offs took their blocks
            if free < self.kv_pressure_below:
                # Idle session pins give way to other requests before any preemption: room, not
                # pressure (a worker full of them ran every step at the smallest target).
                free += step.kv_reclaimable_fraction
            if free < self.kv_pressure_below:  # KV pressure: shorter steps (see the module docstring)
                scale = max(self.kv_pressure_min_scale, free / self.kv_pressure_below)
        budget = self._prefill_budget(step.tokens_left, decodes, context, slo, prefills, waiting, scale)
        for r in prefills:
            if budget <= 0 or not step.tokens_left:
                return
            budget -= step.add(r.key, min(r.num_remaining_tokens, budget, step.tokens_left))  # 0: preempted
        for r in waiting:
            if budget <= 0 or not step.tokens_left or not step.seqs_left or step.preempted_any:
                return
            granted = step.add(r.key, min(r.num_remaining_tokens, budget, step.tokens_left))
            if not granted:
                return  # no KV memory for the head: nobody overtakes it
            budget -= granted

    def _prefill_budget(self, tokens_left: int, decodes: int, context: int, slo: float | None,
                        prefills: list[QueuedRequest], waiting: list[QueuedRequest], scale: float = 1.0) -> int:
        """M for this step (see the module docstring, steps 2-3, KV pressure (`scale`) and the
        starvation guard)."""
        target = slo if slo is not None else self.default_itl_slo_s
        if target is None or not decodes:
            self.last_prefill_budget = None
            return tokens_left
        target *= self.target_fraction * scale
        mean_context = context / decodes
        table = self.table
        budget = table.max_prefill(target, mean_context, decodes, tokens_left)
        if budget and table.history_cost_s_per_pair:
            pairs = _history_pairs(budget, prefills, waiting)
            if pairs:
                budget = table.max_prefill(target - table.history_cost_s_per_pair * pairs, mean_context, decodes,
                                           budget)
        budget = min(max(budget, self.min_prefill_tokens), tokens_left)
        self.last_prefill_budget = budget
        return budget

    def observe(self, executed: ExecutedBatch) -> None:
        self.table.observe_shape(executed.shape, executed.latency_s)


def _history_pairs(budget: int, prefills: list[QueuedRequest], waiting: list[QueuedRequest]) -> int:
    """Attention pairs on KV history (sum of l_incr * l_hist) of the chunks a budget of
    `budget` prefill tokens takes, in the order `next_batch` takes them."""
    pairs = 0
    for queue in (prefills, waiting):
        for r in queue:
            n = min(r.num_remaining_tokens, budget)
            pairs += n * r.num_computed_tokens
            budget -= n
            if budget <= 0:
                return pairs
    return pairs
