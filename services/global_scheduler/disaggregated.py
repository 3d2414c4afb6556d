"""Multi-stage baselines: static prefill/decode disaggregation and a fixed-ratio split.

`pd_disaggregated` runs [0, P) on the least-loaded prefill worker and [P, L) on the
least-loaded decode worker. `split` cuts every request at s = ceil(phi * L) (DynaServe's
split point with a fixed phi, for tests and experiments) and runs alpha = [0, s) and
beta = [s, L) on the two least-loaded distinct workers.
"""

from __future__ import annotations

import math

from services.global_scheduler.baselines import LeastLoadedPolicy, colocated_candidates
from services.global_scheduler.policy import (
    ClusterView,
    NoWorkerAvailable,
    Placement,
    PlacementRequest,
    StagePlacement,
    WorkerView,
    worker_rank,
)


def _least_loaded(pool: tuple[WorkerView, ...], scorer: LeastLoadedPolicy) -> WorkerView:
    return min(pool, key=lambda w: (scorer.score(w), w.worker_id))


def two_stage(alpha: WorkerView, beta: WorkerView, split: int, request: PlacementRequest,
              policy: str, reason: str) -> Placement:
    """alpha runs [0, split), beta runs [split, L)."""
    return Placement(
        (StagePlacement(alpha.worker_id, alpha.address, 0, split),
         StagePlacement(beta.worker_id, beta.address, split, request.total_len)),
        policy, reason,
    )


class PdDisaggregatedPolicy:
    """Prefill pool -> decode pool, least loaded within each (colocated when a pool is empty).

    `prefill_routing="round_robin"` takes the prefill workers in turn instead (SGLang's
    default data-parallel dispatch: the "vanilla PD" baseline of LAPS' evaluation)."""

    name = "pd_disaggregated"

    def __init__(self, prefill_routing: str = "least_loaded", **scorer_params):
        if prefill_routing not in ("least_loaded", "round_robin"):
            raise ValueError(f"prefill_routing must be least_loaded or round_robin, got {prefill_routing!r}")
        self.prefill_routing = prefill_routing
        self._last_prefill = ""
        self.scorer = LeastLoadedPolicy(**scorer_params)

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        prefill_pool, decode_pool = view.by_role("prefill"), view.by_role("decode")
        if not prefill_pool or not decode_pool or request.max_tokens == 0:
            # Without both pools there is nothing to disaggregate; serve rather than fail.
            chosen = _least_loaded(colocated_candidates(view), self.scorer)
            missing = "prefill" if not prefill_pool else "decode"
            return Placement.single_stage(chosen, request, self.name, f"no {missing} worker: colocated")
        if self.prefill_routing == "round_robin":  # the pool is sorted by worker id
            prefill = next((w for w in prefill_pool if w.worker_id > self._last_prefill), prefill_pool[0])
            self._last_prefill = prefill.worker_id
        else:
            prefill = _least_loaded(prefill_pool, self.scorer)
        decode = _least_loaded(decode_pool, self.scorer)
        return two_stage(prefill, decode, request.prompt_len, request, self.name,
                         f"prefill on {prefill.worker_id}, decode on {decode.worker_id}")



class SplitPolicy:
    """Splits every request at ceil(phi * L) across the two least-loaded workers."""

    name = "split"

    def __init__(self, split_ratio: float | str = 0.5, **scorer_params):
        phi = float(split_ratio)
        if not 0.0 < phi < 1.0:
            raise ValueError(f"split_ratio must be in (0, 1), got {split_ratio!r}")
        self.split_ratio = phi
        self.scorer = LeastLoadedPolicy(**scorer_params)

    def split_point(self, total_len: int) -> int:
        """s = ceil(phi * L), kept inside [1, L - 1] so both stages are non-empty."""
        return min(max(1, math.ceil(self.split_ratio * total_len)), total_len - 1)

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        pool = sorted(view.eligible, key=lambda w: (self.scorer.score(w), w.worker_id))
        if not pool:
            raise NoWorkerAvailable(f"no eligible worker among {len(view.workers)} known")
        if len(pool) == 1 or request.total_len < 2:
            return Placement.single_stage(pool[0], request, self.name, "one eligible worker: colocated")
        split = self.split_point(request.total_len)
        # The first stage on the lower-ranked worker: its KV may only be pushed up the order.
        alpha, beta = sorted(pool[:2], key=worker_rank)
        return two_stage(alpha, beta, split, request, self.name,
                         f"phi={self.split_ratio} split at {split} of {request.total_len}")

