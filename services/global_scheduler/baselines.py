"""Baseline placement policies: round robin and least loaded, both colocated (one stage)."""

from __future__ import annotations

import math

from services.global_scheduler.policy import (
    ClusterView,
    NoWorkerAvailable,
    Placement,
    PlacementRequest,
    WorkerView,
)


def colocated_candidates(view: ClusterView) -> tuple[WorkerView, ...]:
    """Eligible workers that run whole requests: role "both", or any role when none has it."""
    both = view.by_role("both")
    candidates = both or view.eligible
    if not candidates:
        raise NoWorkerAvailable(
            f"no eligible worker among {len(view.workers)} known (all draining or none registered)"
        )
    return candidates


class RoundRobinPolicy:
    """Cycles through the colocated candidates in worker-id order."""

    name = "round_robin"

    def __init__(self) -> None:
        # The last chosen id, not an index: workers joining or leaving between calls must
        # not make the cycle skip or repeat the others.
        self._last_worker_id: str | None = None

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        """The first candidate after the previously chosen worker id, wrapping around."""
        candidates = colocated_candidates(view)  # sorted by worker id
        chosen = candidates[0]
        if self._last_worker_id is not None:
            chosen = next((w for w in candidates if w.worker_id > self._last_worker_id), candidates[0])
        self._last_worker_id = chosen.worker_id
        return Placement.single_stage(chosen, request, self.name, f"next in turn of {len(candidates)}")



class LeastLoadedPolicy:
    """Places on the colocated candidate with the lowest load score (ties: smallest worker id).

    score = (1 - free_blocks / total_blocks)
            + queued_prefill_tokens / prefill_token_scale
            + (running + waiting + inflight_assigned) / request_scale

    Each term is "fraction of one worker's capacity in use": the KV cache filled, prefill
    work queued in units of one step's token budget (default 2048 tokens, the worker's
    default max_num_batched_tokens), and requests held in units of `request_scale`.
    inflight_assigned counts requests placed since the last load snapshot, so a burst
    within one refresh interval spreads out instead of piling onto the same worker.
    A worker that reports no KV cache (total_blocks 0) counts as full on the KV term.
    """

    name = "least_loaded"

    def __init__(self, prefill_token_scale: float | str = 2048.0, request_scale: float | str = 16.0):
        # Parameters may arrive as strings (SetPolicy's params map).
        self.prefill_token_scale = _positive(prefill_token_scale, "prefill_token_scale")
        self.request_scale = _positive(request_scale, "request_scale")

    def score(self, worker: WorkerView) -> float:
        """Load score of one worker; lower is less loaded."""
        load = worker.load
        kv_used = 1.0 - load.free_kv_fraction if load.total_blocks > 0 else 1.0
        queued = load.queued_prefill_tokens / self.prefill_token_scale
        requests = (load.running + load.waiting + worker.inflight_assigned) / self.request_scale
        return kv_used + queued + requests

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        """The candidate with the lowest score."""
        candidates = colocated_candidates(view)
        chosen = min(candidates, key=lambda w: (self.score(w), w.worker_id))
        reason = f"lowest load score {self.score(chosen):.3f} of {len(candidates)}"
        return Placement.single_stage(chosen, request, self.name, reason)


class SessionAffinityPolicy(LeastLoadedPolicy):
    """Colocated serving that keeps a session on its bound worker (vLLM-Continuum-like).

    A session's later rounds go where its history's KV is pinned (`bound_worker`), so the
    history hits the prefix cache there; a new session, a request without one, or a
    session whose worker is gone or draining goes to the least loaded worker (which then
    becomes the session's worker when the round ends).
    """

    name = "session_affinity"

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        if request.bound_worker:
            bound = next((w for w in colocated_candidates(view) if w.worker_id == request.bound_worker), None)
            if bound is not None:
                return Placement.single_stage(bound, request, self.name,
                                              f"session {request.session_id} bound to {bound.worker_id} "
                                              f"({request.history_len} history tokens there)")
        placement = super().place(request, view, now)
        if request.bound_worker:  # re-bound: the history is recomputed on the new worker
            return Placement(placement.stages, self.name,
                             f"bound worker {request.bound_worker} unavailable; {placement.reason}",
                             placement.decision)
        return Placement(placement.stages, self.name, placement.reason, placement.decision)


def _positive(value: float | str, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number
