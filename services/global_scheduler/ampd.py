"""AMPD's global scheduler: bind each session to a decode worker, route every prefill.

Paper: AMPD §3 (workflow: bind, route, prefill, decode) and §4.1, Algorithm 1 with the
cost estimates of Eq. 1-2 (`../shared/papers/ampd.txt` in the development tree).

* **Binding.** A session's first round (or any request without a session, or a session
  whose worker is gone) is bound to the decode worker with the most free KV memory; the
  decode worker keeps the session's history KV between rounds (`SessionHold`, pinned by
  `splitserve.core.session_pins`) and runs all its decodes.
* **Routing** (Alg. 1) of each prefill, initial or incremental:
  1. *remote* on a prefill worker, tried in random order, whose windowed TTFT (mean over
     the last window, 10 s by default: `--latency-window-s`) is at most α·TTFT_SLO;
  2. else *local* on the bound decode worker if its windowed ITL is at most β·ITL_SLO;
  3. else the cheapest of local (Eq. 1: this prefill plus the decode worker's queued
     prefills) and every remote (Eq. 2: prefill on the prefill worker, the history's KV
     pulled there and the new KV pushed back, plus its queued prefills).
  A remote plan is two stages, (prefill worker: [0, P)) then (decode worker: [P, L));
  the coordinator wires the history pull and the push back of the new KV. A local plan
  is one stage on the decode worker, where the pinned history is a prefix-cache hit.

Differences from the paper, and why:

* step 1 also requires the prefill worker's *predicted* cost (Eq. 2) to fit within the
  TTFT SLO. The windowed TTFT lags: a burst routed within one window does not show in
  it until its prefills finish, so without this check every request of the burst goes
  to the same "slack" worker. The queue (Redis `worker:{id}:prefillq`, plus what this
  policy placed there since that worker's last snapshot) shows the burst at once;
* a worker with no samples in the window (idle, or just started) has full slack;
* among the workers with slack, step 1 takes the cheapest by Eq. 2 (its queue included), not
  the first in random order (`slack_choice="random"`, the paper's line 1): a random split of
  the prefills makes each worker its own queue, the cheapest choice makes the pool one. The
  planner measured it on DuReader (16 x H200, three TP-4 prefill workers at 5.5 sessions/s):
  P95 TTFT 1,192 ms for one worker at a third of the load, 483 ms for the three sharing a
  queue-aware choice (Erlang C predicts the ratio);
* with no SLO on the request and none configured (`ttft_slo_ms`, `itl_slo_ms`), steps 1
  and 2 have no threshold to compare with: routing goes straight to the cost rule;
* `routing="remote"` (always step 1's worker, else the cheapest remote) and
  `routing="local"` are the ablations of the evaluation (AMPD without adaptive routing);
  `routing="share"` prefills a fixed `local_share` of the rounds locally (chosen by a
  stable hash of the request id, `runs_locally`) and the rest as "remote" does: what the
  planner (`splitserve plan`) simulates to see a decode worker under the local prefills
  adaptive routing sends it when the prefill pool is busy.

Pure: the signals (windowed TTFT/ITL, prefill queues) come with the `ClusterView`
(`WorkerView.signals`), filled by the scheduler from Redis and by the simulator from its
workers, because this policy asks for them (`view_signals = True`).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from services.global_scheduler.baselines import colocated_candidates
from services.global_scheduler.disaggregated import two_stage
from services.global_scheduler.policy import (ClusterView, NoWorkerAvailable, Placement, PlacementRequest,
                                              WorkerView, worker_rank)
from splitserve.perf.model import PerfModel

DEFAULT_PERF_MODEL = "H100/llama-3-8b"
ROUTINGS = ("adaptive", "remote", "local", "share")
# Alg. 1 lines 1-3 among the prefill workers with TTFT slack: the cheapest by Eq. 2, or the paper's random order.
SLACK_CHOICES = ("cheapest", "random")

# Step of Alg. 1 that decided, as recorded in the decision (Prometheus and the request record).
RULE_TTFT_SLACK, RULE_ITL_SLACK, RULE_COST, RULE_NO_CHOICE, RULE_FIXED = 1.0, 2.0, 3.0, 0.0, 4.0


@dataclass(frozen=True)
class Route:
    """Where one prefill runs and the estimates behind it."""

    prefill_worker: WorkerView | None  # None: local on the decode worker
    rule: float
    t_local_s: float
    t_remote_s: float  # the chosen (or cheapest) remote's Eq. 2 cost; inf without prefill workers


class AmpdPolicy:
    """Session binding plus AMPD's adaptive routing of initial and incremental prefills."""

    name = "ampd"
    uses_perf_model = True  # make_policy hands it the deployment's model when none is named
    view_signals = True  # the view must carry windowed TTFT/ITL and prefill queues

    def __init__(self, perf_model: PerfModel | str | None = None, alpha: float | str = 0.9,
                 beta: float | str = 0.85, ttft_slo_ms: float | str = 0.0, itl_slo_ms: float | str = 0.0,
                 routing: str = "adaptive", seed: int | str = 0, local_share: float | str = 0.0,
                 slack_choice: str = "cheapest"):
        if perf_model is None or isinstance(perf_model, str):
            from splitserve.perf.store import resolve_perf_model  # names: presets, JSON files, redis:ID
            perf_model = resolve_perf_model(perf_model or DEFAULT_PERF_MODEL)
        self.perf_model = perf_model
        self.alpha = _fraction(alpha, "alpha")
        self.beta = _fraction(beta, "beta")
        self.ttft_slo_s = _nonnegative(ttft_slo_ms, "ttft_slo_ms") / 1000.0
        self.itl_slo_s = _nonnegative(itl_slo_ms, "itl_slo_ms") / 1000.0
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing = routing
        self.local_share = _nonnegative(local_share, "local_share")
        if self.local_share > 1:
            raise ValueError(f"local_share must be in [0, 1], got {local_share!r}")
        if self.local_share and routing != "share":
            raise ValueError(f"local_share applies to routing='share' only, got routing={routing!r}")
        if slack_choice not in SLACK_CHOICES:
            raise ValueError(f"slack_choice must be one of {', '.join(SLACK_CHOICES)}, got {slack_choice!r}")
        self.slack_choice = slack_choice
        # Alg. 1 line 1 tries prefill workers "in random order" (slack_choice="random"): seeded, so runs repeat.
        self._rng = random.Random(int(seed))
        # Prefills placed on each worker since its load snapshot (updated_unix): the
        # published queue does not show them yet. worker id -> (snapshot time, seconds).
        self._placed_since: dict[str, tuple[float, float]] = {}

    # ---- the decision ------------------------------------------------------------------
    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        decode = self._bound_decode_worker(request, view)
        rebound = bool(request.bound_worker) and decode.worker_id != request.bound_worker
        # The history is on the decode worker only if that is the session's worker.
        history = request.history_len if not rebound else 0
        new_tokens = request.prompt_len - history
        prefill_pool = tuple(w for w in view.by_role("prefill") if worker_rank(w) < worker_rank(decode))
        if request.max_tokens == 0 or not prefill_pool:
            route = Route(None, RULE_NO_CHOICE, self._local_cost(decode, history, new_tokens), float("inf"))
        else:
            route = self._route(request, decode, prefill_pool, history, new_tokens)
        cost = route.t_local_s if route.prefill_worker is None else route.t_remote_s
        target = decode if route.prefill_worker is None else route.prefill_worker
        self._note_placed(target, self.perf_model.prefill_time(history if target is decode else 0,
                                                               new_tokens if target is decode else request.prompt_len))
        decision = {"remote": 0.0 if route.prefill_worker is None else 1.0, "rule": route.rule,
                    "t_local_s": route.t_local_s, "t_remote_s": route.t_remote_s, "history_len": float(history),
                    "rebound": 1.0 if rebound else 0.0}
        binding = f"session {request.session_id} on {decode.worker_id}" if request.session_id else \
            f"decode on {decode.worker_id}"
        if rebound:
            binding += f" (re-bound from {request.bound_worker}: history recomputed)"
        if route.prefill_worker is None:
            placement = Placement.single_stage(decode, request, self.name,
                                               f"{binding}; prefill local ({_RULES[route.rule]}, {cost * 1e3:.1f} ms)")
            return Placement(placement.stages, self.name, placement.reason, decision)
        placement = two_stage(route.prefill_worker, decode, request.prompt_len, request, self.name,
                              f"{binding}; prefill remote on {route.prefill_worker.worker_id} "
                              f"({_RULES[route.rule]}, {cost * 1e3:.1f} ms)")
        return Placement(placement.stages, self.name, placement.reason, decision)

    def _route(self, request: PlacementRequest, decode: WorkerView, prefill_pool: tuple[WorkerView, ...],
               history: int, new_tokens: int) -> Route:
        """Alg. 1 over the prefill workers that may push to `decode`."""
        ttft_slo = request.slo_ttft_ms / 1000.0 if request.slo_ttft_ms else self.ttft_slo_s
        itl_slo = request.slo_itl_ms / 1000.0 if request.slo_itl_ms else self.itl_slo_s
        t_local = self._local_cost(decode, history, new_tokens)
        remote_costs = {w.worker_id: self._remote_cost(w, request.prompt_len, history, new_tokens)
                        for w in prefill_pool}
        cheapest = min(prefill_pool, key=lambda w: (remote_costs[w.worker_id], w.worker_id))
        t_cheapest = remote_costs[cheapest.worker_id]
        if self.routing == "local" or (self.routing == "share" and runs_locally(request.request_id, self.local_share)):
            return Route(None, RULE_FIXED, t_local, t_cheapest)
        if self.routing == "adaptive" and ttft_slo > 0:  # lines 1-3
            order = list(prefill_pool)
            if self.slack_choice == "random":
                self._rng.shuffle(order)
            else:  # the cheapest with slack: the pool shares one queue instead of splitting at random
                order.sort(key=lambda w: (remote_costs[w.worker_id], w.worker_id))
            for worker in order:
                ttft = worker.signals.ttft_mean_s if worker.signals is not None else None
                if (ttft is None or ttft <= self.alpha * ttft_slo) and remote_costs[worker.worker_id] <= ttft_slo:
                    return Route(worker, RULE_TTFT_SLACK, t_local, remote_costs[worker.worker_id])
        if self.routing in ("remote", "share"):
            return Route(cheapest, RULE_FIXED, t_local, t_cheapest)
        if itl_slo > 0:  # lines 4-5
            itl = decode.signals.itl_mean_s if decode.signals is not None else None
            if itl is None or itl <= self.beta * itl_slo:
                return Route(None, RULE_ITL_SLACK, t_local, t_cheapest)
        if t_local <= t_cheapest:  # lines 6-9 (ties: local, which moves no KV)
            return Route(None, RULE_COST, t_local, t_cheapest)
        return Route(cheapest, RULE_COST, t_local, t_cheapest)

    # ---- Eq. 1-2 -------------------------------------------------------------------------
    def _local_cost(self, decode: WorkerView, history: int, new_tokens: int) -> float:
        """Eq. 1: T_pre(l_hist, l_incr; θ_d) plus the decode worker's queued prefills."""
        return self.perf_model.prefill_time(history, new_tokens) + self._queued_s(decode)

    def _remote_cost(self, prefill: WorkerView, prompt_len: int, history: int, new_tokens: int) -> float:
        """Eq. 2: T_pre on the prefill worker + T_kv(history there) + T_kv(new KV back) + its queue."""
        model = self.perf_model
        return (model.prefill_time(history, new_tokens) + model.kv_transfer_time(history)
                + model.kv_transfer_time(prompt_len - history) + self._queued_s(prefill))

    def _queued_s(self, worker: WorkerView) -> float:
        """Σ T_pre over the worker's published prefill queue, plus what was placed there since."""
        queue = worker.signals.prefill_queue if worker.signals is not None else ()
        published = sum(self.perf_model.prefill_time(task.l_hist, task.l_incr) for task in queue)
        snapshot, placed = self._placed_since.get(worker.worker_id, (None, 0.0))
        return published + (placed if snapshot == worker.load.updated_unix else 0.0)

    def _note_placed(self, worker: WorkerView, seconds: float) -> None:
        snapshot, placed = self._placed_since.get(worker.worker_id, (None, 0.0))
        if snapshot != worker.load.updated_unix:
            placed = 0.0  # a newer snapshot's queue includes what was placed before it
        self._placed_since[worker.worker_id] = (worker.load.updated_unix, placed + seconds)

    # ---- binding -------------------------------------------------------------------------
    @staticmethod
    def _bound_decode_worker(request: PlacementRequest, view: ClusterView) -> WorkerView:
        """The session's worker while it can take work; else the decode worker with most free KV."""
        pool = view.by_role("decode") or colocated_candidates(view)
        if request.bound_worker:
            bound = next((w for w in pool if w.worker_id == request.bound_worker), None)
            if bound is not None:
                return bound
        if not pool:
            raise NoWorkerAvailable(f"no eligible decode worker among {len(view.workers)} known")
        # Binding by memory (AMPD §3 step 1); ties: fewer requests there, then the id.
        return max(pool, key=lambda w: (w.free_kv_fraction, -(w.load.running + w.load.waiting + w.inflight_assigned),
                                        _reverse(w.worker_id)))


_RULES = {RULE_TTFT_SLACK: "TTFT slack", RULE_ITL_SLACK: "ITL slack", RULE_COST: "least cost",
          RULE_NO_CHOICE: "no prefill worker", RULE_FIXED: "fixed routing"}


def _reverse(text: str) -> tuple[int, ...]:
    """A key that sorts strings in reverse, so max() breaks ties by the smallest id."""
    return tuple(-ord(c) for c in text)


def _fraction(value: float | str, name: str) -> float:
    number = _nonnegative(value, name)
    if not 0 < number <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return number


def _nonnegative(value: float | str, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def runs_locally(request_id: str, local_share: float) -> bool:
    """Whether `request_id` is among the `local_share` of rounds `routing="share"` prefills
    locally: a stable hash, so a run repeats and the set is known when reading its results."""
    return zlib.crc32(request_id.encode()) / 2**32 < local_share
