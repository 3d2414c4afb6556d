"""Per-step cost of the slo_aware batch policy, beside fcfs.

The policies' own work only: `next_batch` over a step builder that grants every `add` at
once (the core's `_Step` does the same bookkeeping, block accounting aside, for every
policy alike). Each row is a worker with `decodes` running decodes of 1,000-token contexts
under a 100 ms ITL SLO and 8 long prompts waiting (the case slo_aware does the most work
in: every decode, the target, MaxPrefillAllowed twice, then chunks). Then the table alone:
`max_prefill` (MaxPrefillAllowed), `observe` of a mixed step (what `update_from_output`
adds through `policy.observe`), `predict_shape`. Medians of --repeat measurements.

    .venv/bin/python benchmarks/slo_aware_policy.py
    .venv/bin/python benchmarks/slo_aware_policy.py --decodes 16,64,256 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import common  # noqa: F401  (puts the repository on sys.path)

from splitserve.core import (FcfsPolicy, LatencyTable, QueuedRequest, SloAwarePolicy, StageKey,  # noqa: E402
                             StepBudget, StepShape, step_time)
from splitserve.perf.presets import preset  # noqa: E402

MODEL = preset("A100", "Qwen2.5-14B")


class GrantingStep:
    """A StepBuilder that grants every add (the policy's decisions, none of the memory)."""

    def __init__(self, running, waiting, budget: StepBudget):
        self.running, self.waiting, self.budget = running, waiting, budget
        self.tokens_left = budget.max_num_batched_tokens
        self.seqs_left = budget.max_num_seqs - len(running)
        self.preempted_any = False
        self.kv_free_fraction = 1.0  # none of the memory: no KV pressure
        self.kv_reclaimable_fraction = 0.0

    def add(self, key, num_tokens: int) -> int:
        self.tokens_left -= num_tokens
        return num_tokens

    def hold_until(self, t: float) -> None:
        pass


def queues(decodes: int):
    running = [QueuedRequest(StageKey(f"d{i}", 0), 0.0, 1000, 1001 + i, 1000 + i, itl_slo_s=0.1)
               for i in range(decodes)]
    waiting = [QueuedRequest(StageKey(f"long{i}", 0), 1.0, 6000, 6000, 0, itl_slo_s=0.1) for i in range(8)]
    return running, waiting


def next_batch_us(policy, decodes: int, number: int) -> float:
    running, waiting = queues(decodes)
    budget = StepBudget(2048, 512)
    return timeit.timeit(lambda: policy.next_batch(GrantingStep(running, waiting, budget), 0.0),
                         number=number) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", default="16,64,256", help="running decodes per row (comma list)")
    parser.add_argument("--number", type=int, default=2000, help="calls per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per figure (the median is shown)")
    args = parser.parse_args()

    print(f"{'decodes':>8} {'fcfs us':>10} {'slo_aware us':>13} {'prefill M':>10}")
    for decodes in [int(x) for x in args.decodes.split(",")]:
        fcfs, slo = FcfsPolicy(), SloAwarePolicy(MODEL)
        costs = [statistics.median(next_batch_us(p, decodes, args.number) for _ in range(args.repeat))
                 for p in (fcfs, slo)]
        print(f"{decodes:>8} {costs[0]:>10.1f} {costs[1]:>13.1f} {slo.last_prefill_budget:>10}")

    table = LatencyTable(MODEL)
    shape = StepShape(((3000, 400),), 64, 64 * 1500)
    latency = step_time(MODEL, shape) * 1.05
    n = 20_000
    for label, fn in (("max_prefill", lambda: table.max_prefill(0.09, 1500.0, 64)),
                      ("observe (mixed step)", lambda: table.observe_shape(shape, latency)),
                      ("predict_shape", lambda: table.predict_shape(shape))):
        us = statistics.median(timeit.timeit(fn, number=n) / n * 1e6 for _ in range(args.repeat))
        print(f"LatencyTable.{label}: {us:.1f} us")


if __name__ == "__main__":
    main()
