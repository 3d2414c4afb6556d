"""LAPS' instance-pressure controller: how many prefill workers serve short and how many long prefills.

Paper: LAPS §3.2, Algorithm 2 (`../shared/papers/laps.txt` in the development tree). The
prefill workers form two pools, short (n_s) and long (n_l = N - n_s). Every control period
Δt the controller measures each instance k's pressure

    ψ_k = α·q_k + β·e_k − γ·u_k

aggregates each pool robustly (P90 of its instances' ψ), and, once the cool-down T_cool
since its last move has passed, moves at most one instance: from long to short when
P_s > (1+τ)·P_l, from short to long when P_l > (1+τ)·P_s (τ the hysteresis), never leaving
a pool with fewer than n_min instances. A move is `Worker.SetRole(role="prefill",
pool=...)`: it only steers where new work goes; what the worker has queued runs on (its
local `laps` batch policy keeps short and long apart in time), so no request is lost or
recomputed because of a move.

The terms, each in units that make α = β = 1 meaningful:
* q_k: the instance's queued prefill work, as the time the performance model gives for
  its queued prefill tokens, in units of the TTFT SLO;
* e_k: its SLA deviation, how far its windowed mean TTFT exceeds the SLO, in units of the
  SLO (0 when within it);
* u_k: its *spare* capacity, 1 − the share of the last interval its engine was stepping.

Differences from the paper, and why:
* u_k is the spare share, not the utilisation: with ψ = … − γ·utilisation a saturated pool
  would read as *less* pressed than an idle one and the controller would move instances
  away from it; subtracting the spare share keeps the sign the paper intends (an idle
  instance can give itself away);
* pool pressures are clipped at 0 and a move also needs P_s − P_l ≥ `min_gap`: Alg. 2's
  ratio test alone moves an instance back and forth between two idle pools (0 > 1.25·0 is
  false, but −0.1 > 1.25·(−0.2) is true);
* the instance moved is the donor pool's least pressed one (Alg. 2 leaves it open): it has
  the least old-class work left to finish;
* prefill workers in no pool yet (started with `--prefill-pool ''`) are assigned first,
  each to the smaller pool (short first), not counted as a move; with fewer than
  2·n_min prefill workers there are no pools (the single instance runs both classes apart
  in time: temporal mode);
* a pool found below n_min (its worker died or drains, an operator moved one) gets an
  instance from the other pool at once, cool-down or not;
* the donor guard (`max_donor_busy`, not in the paper; off in this config, Alg. 2 as
  published, on at 0.9 in the `laps` policy that builds the controller): a hill-climb move is refused
  when the donor pool's busy share, spread over one instance fewer, would exceed the bound.
  Measured on the multi-turn workload (docs/laps_measured.md §3): with 69% of turns short, the
  long pool's P90 pressure spikes (one long prefill queued) outweigh a short pool of two
  instances that is just keeping up, the controller takes one, the remaining short instance
  saturates, and the pools oscillate between one and two short instances every ~10 s.

Pure: the caller (the scheduler's controller task, the simulator) hands it the cluster
view and the time, and applies what it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.global_scheduler.policy import ClusterView, WorkerView
from splitserve.perf.model import PerfModel
from splitserve.core.records import nearest_rank

__all__ = ["InstancePressure", "PoolController", "PoolControllerConfig", "PoolDecision", "PoolMove", "percentile"]

SHORT, LONG = "short", "long"


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (always one of the values); 0 for none."""
    return nearest_rank(sorted(values), p) if values else 0.0


# Without a performance model, queued prefill tokens turn into time at this rate (a
# mid-size GPU's prefill): only the order of instances and the pressure's scale need it.
NO_MODEL_PREFILL_TOKENS_PER_S = 20_000.0


def queued_prefill_s(perf_model: PerfModel | None, tokens: int) -> float:
    """Predicted time to run `tokens` queued prefill tokens (the model's, else the fixed rate)."""
    if not tokens:
        return 0.0
    if perf_model is None:
        return tokens / NO_MODEL_PREFILL_TOKENS_PER_S
    return perf_model.prefill_time(0, tokens)


@dataclass(frozen=True)
class PoolControllerConfig:
    """Alg. 2's inputs: Δt, T_cool, τ, n_min, (α, β, γ), the aggregator's percentile."""

    period_s: float = 1.0  # Δt
    cool_down_s: float = 5.0  # T_cool
    hysteresis: float = 0.25  # τ
    min_per_pool: int = 1  # n_min
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 0.25
    percentile: float = 90.0  # the robust aggregator A(·)
    min_gap: float = 0.05  # P_s − P_l (in SLO units) below which no move is worth its cost
    ttft_slo_s: float = 0.4
    # Refuse a hill-climb move leaving the donor's instances busier than this on average
    # (their busy shares summed over one instance fewer); inf: never (Alg. 2 as published).
    max_donor_busy: float = math.inf

    def __post_init__(self) -> None:
        for name in ("period_s", "ttft_slo_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (self.max_donor_busy > 0 and not math.isnan(self.max_donor_busy)):
            raise ValueError(f"max_donor_busy must be a number > 0 (inf: no bound), got {self.max_donor_busy!r}")
        for name in ("cool_down_s", "hysteresis", "alpha", "beta", "gamma", "min_gap"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.min_per_pool, bool) or not isinstance(self.min_per_pool, int) or self.min_per_pool < 1:
            raise ValueError(f"min_per_pool must be an integer >= 1, got {self.min_per_pool!r}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile!r}")


@dataclass(frozen=True)
class InstancePressure:
    """One prefill instance's measured terms and its pressure ψ_k."""

    worker_id: str
    pool: str
    queue: float  # q_k
    sla_deviation: float  # e_k
    spare: float  # u_k
    pressure: float  # ψ_k


@dataclass(frozen=True)
class PoolMove:
    """Put `worker_id` into `to_pool` (from `from_pool`; "" = none)."""

    worker_id: str
    from_pool: str
    to_pool: str


@dataclass(frozen=True)
class PoolDecision:
    """What one control period found and decided."""

    at: float
    assignments: tuple[PoolMove, ...] = ()  # workers in no pool yet, now given one
    move: PoolMove | None = None  # the one instance migrated (Alg. 2 lines 22-25)
    short_pressure: float = 0.0  # P_s
    long_pressure: float = 0.0  # P_l
    instances: tuple[InstancePressure, ...] = field(default_factory=tuple)

    @property
    def changes(self) -> tuple[PoolMove, ...]:
        """Every SetRole to send: assignments, then the move."""
        return self.assignments + ((self.move,) if self.move is not None else ())


class PoolController:
    """Alg. 2 over a `ClusterView` (the workers' loads and windowed TTFT), one period per `step`."""

    def __init__(self, config: PoolControllerConfig, perf_model: PerfModel | None = None):
        self.config = config
        self.perf_model = perf_model
        self.last_move_at = -math.inf  # t_last
        self.num_moves = 0
        self._move_before = -math.inf  # t_last before the latest move, for `move_failed`

    def move_failed(self) -> None:
        """The latest decision's move did not happen (its SetRole failed): it neither counts
        nor starts a cool-down, so the next period may decide it again."""
        self.last_move_at = self._move_before
        self.num_moves -= 1

    def pressure(self, worker: WorkerView) -> InstancePressure:
        """ψ_k = α·q_k + β·e_k − γ·u_k of one prefill instance."""
        c, load = self.config, worker.load
        queue = queued_prefill_s(self.perf_model, load.queued_prefill_tokens) / c.ttft_slo_s
        ttft = worker.signals.ttft_mean_s if worker.signals is not None else None
        deviation = max(0.0, ttft / c.ttft_slo_s - 1.0) if ttft is not None else 0.0
        spare = 1.0 - min(1.0, max(0.0, load.busy_fraction))
        return InstancePressure(worker.worker_id, load.pool, queue, deviation, spare,
                                c.alpha * queue + c.beta * deviation - c.gamma * spare)

    def _donor_keeps_up(self, donor: list[InstancePressure]) -> bool:
        """Whether the donor pool's work fits one instance fewer (`max_donor_busy`)."""
        if math.isinf(self.config.max_donor_busy):
            return True
        busy = sum(1.0 - i.spare for i in donor)
        return busy / (len(donor) - 1) <= self.config.max_donor_busy

    def step(self, view: ClusterView, now: float) -> PoolDecision:
        """One control period: assign unpooled prefill workers, measure, maybe move one instance."""
        c = self.config
        prefill = [w for w in view.by_role("prefill")]
        if len(prefill) < 2 * c.min_per_pool:
            return PoolDecision(now)  # too few for two pools: temporal mode on each instance
        pools = {w.worker_id: w.load.pool for w in prefill}
        assignments = []
        for w in prefill:
            if pools[w.worker_id] not in (SHORT, LONG):
                sizes = {p: sum(1 for v in pools.values() if v == p) for p in (SHORT, LONG)}
                target = SHORT if sizes[SHORT] <= sizes[LONG] else LONG
                pools[w.worker_id] = target
                assignments.append(PoolMove(w.worker_id, w.load.pool, target))
        instances = tuple(self.pressure(w) for w in prefill)
        by_pool = {p: [i for i in instances if pools[i.worker_id] == p] for p in (SHORT, LONG)}
        p_short = max(0.0, percentile([i.pressure for i in by_pool[SHORT]], c.percentile))
        p_long = max(0.0, percentile([i.pressure for i in by_pool[LONG]], c.percentile))
        decision = PoolDecision(now, tuple(assignments), None, p_short, p_long, instances)
        pressures = {SHORT: p_short, LONG: p_long}
        # A pool below n_min (a worker left, an operator moved one) is refilled first, at once;
        # otherwise a hill-climb step (Alg. 2 lines 22-25), once the cool-down has passed.
        receiver = next((pool for pool, other in ((SHORT, LONG), (LONG, SHORT))
                         if len(by_pool[pool]) < c.min_per_pool < len(by_pool[other])), None)
        if receiver is None and now - self.last_move_at >= c.cool_down_s:
            receiver = next((pool for pool, other in ((SHORT, LONG), (LONG, SHORT))
                             if pressures[pool] > (1 + c.hysteresis) * pressures[other]
                             and pressures[pool] - pressures[other] >= c.min_gap
                             and len(by_pool[other]) > c.min_per_pool
                             and self._donor_keeps_up(by_pool[other])), None)
        if receiver is None:
            return decision
        donor = by_pool[LONG if receiver == SHORT else SHORT]
        # The least pressed donor instance has the least old-class work left to finish.
        chosen = min(donor, key=lambda i: (i.pressure, i.queue, i.worker_id))
        self._move_before, self.last_move_at = self.last_move_at, now
        self.num_moves += 1
        return PoolDecision(now, tuple(assignments), PoolMove(chosen.worker_id, pools[chosen.worker_id], receiver),
                            p_short, p_long, instances)
