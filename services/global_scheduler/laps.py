"""LAPS' global scheduler: short and long (re-)prefills on separate prefill pools.

Paper: LAPS §3.2, spatial disaggregation (`../shared/papers/laps.txt` in the development
tree). A (re-)prefill of L new tokens on a history of H cached tokens is short when
L < L_m(H) (`splitserve.core.length_class`, the same boundary the workers' local `laps`
batch policy uses) and goes to the short pool, else to the long pool; a short prefill
never queues behind a long one. The pools are the prefill workers' `pool` label, kept
balanced by the instance-pressure controller (`pool_controller`, Alg. 2), which this
policy builds for the scheduler and the simulator (`pool_controller()`). Decode runs on
the least-loaded decode worker (or the session's bound one, where its history is pinned).

* Within a pool: the instance with the least predicted prefill backlog (its queued prefill
  tokens, plus those this scheduler placed there since its last load snapshot, as time
  by the performance model).
* Long overflow (not in the paper): when the long pool's best backlog exceeds
  `overflow_ms` (default: an eighth of the TTFT SLO) and a short-pool instance would start
  the long prefill sooner, it goes there. With few instances the pools' sizes are too
  coarse for the load (2 prefill instances: one long instance saturates while the short
  one idles, and the controller may not move below n_min); the workers' local `laps`
  batch policy keeps a visiting long prefill from delaying the short ones by more than
  one chunk, so it costs the short pool little and saves the long one a queue. Short
  prefills never overflow: in the long pool they would wait behind whole-budget chunks,
  and their own pool batches them (a short pool whose backlog counts visiting long
  prefills would otherwise push its shorts away and mix both pools).
* A class whose pool is empty (not assigned yet, or every instance of it draining) goes to
  the unpooled prefill workers, else to the other pool: serve rather than fail.
* No prefill workers (every worker "both"): temporal mode, colocated on the least-loaded
  worker, whose local `laps` batch policy keeps the classes apart in time.
* The controller's donor guard (`max_donor_busy`, not in the paper; `pool_controller`) is on
  at 0.9 by default: no hill-climb move that leaves the donor pool's instances more than 90%
  busy. Measured (docs/laps_measured.md, §3 and "The donor guard becomes the default"): with
  it LAPS has the fewest SLO violations on multi-turn traffic at every load, is neutral on
  Azure (±1.6 points), and on Mooncake is neutral or better (Qwen2.5-32B at 0.7×: 85.7% →
  78.3% of requests over the SLO, and 64 closed-loop clients no longer collapse its
  throughput, 0.46 → 1.53 req/s). `max_donor_busy=inf` runs Alg. 2 as published.
* L_m follows the workers (`follow_workers`): each prefill worker publishes the L_m(0) its
  local `laps` policy refits online from its measured steps (`WorkerLoad.length_boundary`);
  a model-based boundary here is scaled by the median published L_m(0) over its own, so a
  request is classified alike by the scheduler and by the worker that runs it (a fixed
  `boundary_tokens` is kept as given).

Pure: the view carries the pools, loads and windowed TTFT (`view_signals`, for the
controller's SLA term).
"""

from __future__ import annotations

from services.global_scheduler.baselines import LeastLoadedPolicy, colocated_candidates
from services.global_scheduler.disaggregated import two_stage
from services.global_scheduler.policy import ClusterView, Placement, PlacementRequest, WorkerView
from services.global_scheduler.pool_controller import (LONG, SHORT, PoolController, PoolControllerConfig,
                                                      queued_prefill_s)
from splitserve.core.length_class import LengthBoundary
from splitserve.core.policies.options import flag_option, number_option, perf_model_option

__all__ = ["DEFAULT_MAX_DONOR_BUSY", "LapsPlacementPolicy"]

DEFAULT_MAX_DONOR_BUSY = 0.9  # the donor guard's bound (see the module docstring); inf: off


class LapsPlacementPolicy:
    """Route each (re-)prefill to the short or the long prefill pool by L_m(H)."""

    name = "laps"
    uses_perf_model = True  # make_policy hands it the deployment's model when none is named
    view_signals = True  # the pool controller reads each instance's windowed TTFT

    def __init__(self, perf_model=None, boundary_tokens: int | str | None = None,
                 ttft_slo_ms: float | str = 400.0, period_s: float | str = 1.0, cool_down_s: float | str = 5.0,
                 hysteresis: float | str = 0.25, min_per_pool: int | str = 1, alpha: float | str = 1.0,
                 beta: float | str = 1.0, gamma: float | str = 0.25, min_gap: float | str = 0.05,
                 max_donor_busy: float | str | None = DEFAULT_MAX_DONOR_BUSY, controller: bool | str = True,
                 overflow_ms: float | str | None = None, follow_workers: bool | str = True,
                 prefill_token_scale: float | str = 2048.0, request_scale: float | str = 16.0):
        if isinstance(perf_model, str) and perf_model.strip() and not perf_model.lstrip().startswith("{"):
            from splitserve.perf.store import resolve_perf_model  # names: presets, JSON files, redis:ID

            perf_model = resolve_perf_model(perf_model)
        self.perf_model = perf_model_option(perf_model)
        self.boundary = LengthBoundary(self.perf_model, number_option(
            "boundary_tokens", boundary_tokens, minimum=1, integer=True, allow_none=True))
        self.controller_config = PoolControllerConfig(
            period_s=number_option("period_s", period_s, minimum=1e-3),
            cool_down_s=number_option("cool_down_s", cool_down_s, minimum=0.0),
            hysteresis=number_option("hysteresis", hysteresis, minimum=0.0),
            min_per_pool=number_option("min_per_pool", min_per_pool, minimum=1, integer=True),
            alpha=number_option("alpha", alpha, minimum=0.0), beta=number_option("beta", beta, minimum=0.0),
            gamma=number_option("gamma", gamma, minimum=0.0), min_gap=number_option("min_gap", min_gap, minimum=0.0),
            max_donor_busy=number_option("max_donor_busy", max_donor_busy, minimum=1e-3, allow_inf=True),
            ttft_slo_s=number_option("ttft_slo_ms", ttft_slo_ms, minimum=1e-3) / 1000)
        self.controller_enabled = flag_option("controller", controller)
        self.follow_workers = flag_option("follow_workers", follow_workers)
        self._worker_scale: tuple[float, float] = (float("nan"), 1.0)  # (view time, L_m scale) of the last view
        overflow = number_option("overflow_ms", overflow_ms, minimum=0.0, allow_none=True)
        # inf: never overflow (the paper's strict pools).
        self.overflow_s = self.controller_config.ttft_slo_s / 8 if overflow is None else overflow / 1000
        self.scorer = LeastLoadedPolicy(prefill_token_scale, request_scale)
        # Prefill tokens placed on each worker since its load snapshot (keyed by the
        # snapshot's time): the snapshot does not show them yet.
        self._placed: dict[str, tuple[float, int]] = {}

    def pool_controller(self) -> PoolController | None:
        """A fresh Alg. 2 controller for the caller to run every `period_s` (None: disabled)."""
        if not self.controller_enabled:
            return None
        return PoolController(self.controller_config, self.perf_model)

    def _least_loaded(self, pool: tuple[WorkerView, ...] | list[WorkerView]) -> WorkerView:
        return min(pool, key=lambda w: (self.scorer.score(w), w.worker_id))

    def backlog_s(self, worker: WorkerView) -> float:
        """Predicted time to run the prefill tokens queued on `worker` (snapshot plus placed since)."""
        load = worker.load
        since, placed = self._placed.get(worker.worker_id, (None, 0))
        return queued_prefill_s(self.perf_model,
                                load.queued_prefill_tokens + (placed if since == load.updated_unix else 0))

    def _note_placed(self, worker: WorkerView, tokens: int) -> None:
        since, placed = self._placed.get(worker.worker_id, (None, 0))
        if since != worker.load.updated_unix:
            placed = 0
        self._placed[worker.worker_id] = (worker.load.updated_unix, placed + tokens)

    def _fastest(self, pool: list[WorkerView]) -> tuple[float, WorkerView]:
        return min(((self.backlog_s(w), w) for w in pool), key=lambda bw: (bw[0], self.scorer.score(bw[1]),
                                                                            bw[1].worker_id))

    def boundary_scale(self, view: ClusterView) -> float:
        """Median L_m(0) the prefill workers publish over this policy's own (1: none, or fixed)."""
        if not self.follow_workers or self.boundary.fixed_tokens is not None:
            return 1.0
        taken_at, scale = self._worker_scale
        if taken_at == view.taken_at:
            return scale
        published = sorted(w.load.length_boundary for w in view.by_role("prefill") if w.load.length_boundary > 0)
        own = self.boundary.tokens(0)
        scale = 1.0
        if published and 0 < own < float("inf"):
            scale = published[len(published) // 2] / own
        self._worker_scale = (view.taken_at, scale)
        return scale

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        history = request.history_len
        l_m = self.boundary.tokens(history) * self.boundary_scale(view)
        short = request.prompt_len - history < l_m
        decision = {"short": 1.0 if short else 0.0, "l_m": l_m if l_m != float("inf") else -1.0}
        prefill_workers = view.by_role("prefill")
        if not prefill_workers:
            chosen = self._least_loaded(colocated_candidates(view))
            placement = Placement.single_stage(chosen, request, self.name, "no prefill worker: temporal mode")
            return Placement(placement.stages, self.name, placement.reason, decision)
        wanted = SHORT if short else LONG
        members = [w for w in prefill_workers if w.load.pool == wanted]
        fallback = overflow = 0.0
        if not members:
            members = [w for w in prefill_workers if w.load.pool not in (SHORT, LONG)] or list(prefill_workers)
            fallback = 1.0
        backlog, prefill = self._fastest(members)
        if not short and not fallback and backlog > self.overflow_s:
            others = [w for w in prefill_workers if w.load.pool == SHORT]
            if others:
                other_backlog, other = self._fastest(others)
                if other_backlog < backlog:
                    backlog, prefill, overflow = other_backlog, other, 1.0
        self._note_placed(prefill, request.prompt_len - history)
        decision.update(pool_fallback=fallback, overflow=overflow, backlog_s=backlog)
        decode_workers = view.by_role("decode")
        if not decode_workers or request.max_tokens == 0:
            placement = Placement.single_stage(prefill, request, self.name,
                                               f"{wanted} prefill on {prefill.worker_id}: no decode stage")
            return Placement(placement.stages, self.name, placement.reason, decision)
        bound = next((w for w in decode_workers if w.worker_id == request.bound_worker), None)
        decode = bound or self._least_loaded(decode_workers)
        placement = two_stage(prefill, decode, request.prompt_len, request, self.name,
                              f"{wanted} prefill (L={request.prompt_len - history}, H={history}, L_m={l_m:.0f}) on "
                              f"{prefill.worker_id}, decode on {decode.worker_id}")
        return Placement(placement.stages, self.name, placement.reason, decision)
