"""Deployment planning for disaggregated multi-round serving (AMPD §5, Eq. 5; Appendix A).

The question: with N GPUs, how many prefill and decode workers, at which TP degrees, so
that the worst-served side is served best. AMPD's ILP (Eq. 5) minimises Z, the largest P95
latency of any instantiated replica, over replica counts x(n), y(n) per TP degree n, with
τ_pre(n), τ_dec(n) as constants taken from a simulator.

**Why not Eq. 5 as written.** With τ(n) a constant per TP degree, a replica's latency does
not depend on how many replicas share the load, so the ILP's optimum is one replica per
side at the fastest TP (any further GPU changes nothing). A replica's P95 latency is a
function of the load it receives: here τ_pre(n, k) is the P95 TTFT of one TP-n prefill
worker receiving 1/k of the session rounds, τ_dec(m, j) the P95 ITL of one TP-m decode
worker holding 1/j of the sessions (its pinned history included). The ILP then chooses
binary u[n, k] (the prefill pool is k workers of TP n) and v[m, j] (the decode pool):

    min Z  s.t.  Σ u = 1,  Σ v = 1,  Σ n·k·u[n,k] + Σ m·j·v[m,j] <= N,
                 Z >= Σ τ_pre(n,k)/TTFT_SLO · u[n,k],  Z >= Σ τ_dec(m,j)/ITL_SLO · v[m,j]

(one TP per pool, as every configuration of the paper's Table 2); ties in Z (both bound by
the same side) go to the deployment whose other side is better served (a secondary term
weighted far below any difference in Z), then to the one using more of the budget. The latencies are
divided by their SLOs: a P95 TTFT in hundreds of milliseconds and a P95 ITL in tens are
not comparable, and unscaled the decode side would never bind. The top configurations
come from solving again with each found one cut off (`scipy.optimize.milp`, HiGHS).

**Coupling: local prefills.** AMPD's adaptive routing (Alg. 1) sends a round's prefill to
the prefill pool while it has slack, and otherwise runs it locally on the session's decode
worker (its history already there: no KV pulled), so under load the decode pool is prefill
capacity too and pays for it in ITL. Curves measured with remote prefills only cannot see
this: they ranked a single small decode worker beside many prefill workers first, where
whole-cluster simulation (and the paper's Table 2) put larger decode workers first. So the
ILP gets one more dimension, the share s of rounds prefilled locally (`LOCAL_SHARES`: none,
a quarter, half, three quarters; whole-cluster simulations of the paper's workloads at half
their prefill capacity at steady state run 0-46% of later rounds locally): u[n, k, s], v[m, j, s], with
Σ_n,k u[n, k, s] = Σ_m,j v[m, j, s] for each s (both pools at the same level; solved as
one ILP per level, merged, see `solve_plan`). At level s the prefill pool gets rate x (1 - s),
and the decode replica's cost is the larger of its P95 ITL / ITL SLO and its local prefills'
P95 TTFT / TTFT SLO, both measured on a decode replica whose share s of rounds is prefilled
locally (the `ampd` policy with `routing="share"`: that share fixed). The ILP picks the level that serves
a deployment best, as the adaptive router moves work to the side with slack. The max of the
two TTFTs bounds the mixture's P95 from above.

**Where τ comes from** (Appendix A.1: the simulator). A replica's latency depends only on
its own load (and, for a decode replica, on s), so each is a *load curve* over the
per-replica session rate, measured by simulating one replica with the real core
(`Simulator`, the session preset's lengths and tool delays): a prefill replica beside
enough TP-8 decode workers that they never run out of KV (TTFT P95), a decode replica fed
by enough TP-8 prefill workers that its remote prefills never queue (ITL P95, the
per-request mean gap; TTFT P95 of its local prefills). Each point is the replica's steady
state: a session lifetime under that load of arrivals first fills it (not measured), then at
least another lifetime and `STEADY_MIN_ROUNDS` rounds are (the later half alone where the
queue still rises); a load with no steady state (a running batch past `max_num_seqs`,
prefills past the whole worker: `loaded_lifetime_s`) is infeasible. The points are rates some candidate
runs at (`initial_points`: among rate x (1 - s) / k for the pool sizes k the budget allows,
at most 3 per prefill curve and 2 per decode curve), then a refinement pass measures the exact rates of the top candidates + `REFINE_TOP` where
the interpolation could be off by more than 10% on the side that sets Z
(`refinement_points`), and the ILP is solved again. Between points, rates are interpolated
(the curve made non-decreasing); past the highest rate a replica keeps up with, it is
infeasible. The number of simulations is bounded per TP degree and share (the refinement
by 2 x (top + `REFINE_TOP`)), so the plan's cost does not grow with N: at 256 GPUs ~19
simulations of at most `MAX_POINT_SESSIONS` sessions, and the ILP (one per share, ~190 binaries each) solves in ~0.3 s.

`check_plan` simulates the top configurations as whole clusters at the planned rate and
ranks them by SLO attainment, a tie going to the lower simulated Z (the paper's Table 2:
planner vs real serving).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from loadgen import arrivals
from loadgen.sessions import PRESETS, ToolDelay, generate_sessions
from services.global_scheduler.ampd import runs_locally
from services.planner.sim_config import MAX_NUM_SEQS
from services.planner.simulator import Simulator
from splitserve.core import known_batch_policies
from splitserve.core.designs import DesignChoice, resolve_design
from splitserve.perf.backends import perf_model_for
from splitserve.perf.model import PerfModel
from splitserve.perf.presets import TP_DEGREES, fits_in_memory, max_kv_tokens

__all__ = ["PlanInputs", "LoadCurve", "Candidate", "solve_plan", "plan", "check_plan", "default_rate",
           "prefill_capacity"]

INFEASIBLE = math.inf
TIE_BREAK = 1e-4  # weight of the secondary objective (see solve_plan)
# The coarse grid (`initial_points`): points per curve, and the highest load measured (the
# per-replica rate as a share of the prefill capacity; for a decode replica, of what its KV
# memory — and with local prefills its compute — can hold). Past the highest load that kept
# up, a replica counts as not keeping up.
PREFILL_POINTS, PREFILL_MAX_LOAD = 3, 0.9
DECODE_POINTS, DECODE_MAX_LOAD = 2, 0.85
# A point is measured at the replica's steady state (`steady_window`): the rounds arriving in the
# first session lifetime under the point's load (the replica filling up) are not measured, then at
# least a lifetime and `STEADY_MIN_ROUNDS` rounds are; where the later half of that window is
# `GROWTH_LIMIT` x slower than its earlier half (a queue still rising, or slow to settle near
# saturation), only the later half is (the structural overloads, a batch past `max_num_seqs` or
# prefills past the whole worker, are infeasible before any simulation: `loaded_lifetime_s`). Before these, a
# point simulated ~2 light-load lifetimes of arrivals at most 150 sessions and measured every round:
# at 71 sessions/s on one TP-8 decode worker (256 H100s, ToolBench) that was 2 s of arrivals, all
# ramp-up — P95 ITL 18.6 ms there, > 100 ms at steady state — and the plan's top deployment had one
# decode worker for 31 prefill workers.
STEADY_MIN_ROUNDS = 240
MAX_POINT_SESSIONS = 1500  # per point (the plan's time); past it the measured window is shorter
CHECK_MAX_SESSIONS = 4000  # a whole-cluster check's sessions, at most
# A prefill curve's first point is the replica nearly idle (this share of its capacity): the P95
# of its service alone, the part of TTFT a pool of replicas cannot shorten (`pooled_prefill_p95`).
UNLOADED_LOAD = 0.05
GROWTH_LIMIT = 2.0  # later half over earlier half: still rising (a settled queue at utilisation 0.42 showed 1.36x)
PREFILL_HELPER_TP = 8  # the fastest workers serve the other side of the replica under test
# Shares of the session rounds whose prefill runs locally on the decode worker (adaptive
# routing's overflow, see "Coupling"): a level of the ILP, one decode curve each.
LOCAL_SHARES = (0.0, 0.25, 0.5, 0.75)
REFINE_TOP = 2  # the refinement pass measures the rates of the top + this many candidates
REFINE_TOLERANCE = 0.1  # a measured point within this relative distance of a rate needs no new one
REFINE_SPREAD = 0.1  # ... nor a rate whose interpolation can be off by at most this share of its value




@dataclass(frozen=True)
class PlanInputs:
    gpus: int
    gpu: str = "H100"
    model: str = "Llama-3.1-70B"
    sessions: str = "toolbench"
    rate: float = 0.0  # sessions/s; 0: `default_rate`
    ttft_slo_ms: float = 350.0
    itl_slo_ms: float = 40.0
    tp_degrees: tuple[int, ...] = TP_DEGREES
    link: str = "rdma-400g"
    # What times the simulated steps (splitserve.perf.backends.perf_model_for).
    perf_backend: str = "auto"
    perf_framework: str = "vllm"
    perf_database_version: str | None = None
    tool_delay_s: float = 1.0
    sim_sessions: int = 48  # sessions per load-curve point (the curve's resolution vs the plan's time)
    seed: int = 0
    top: int = 3
    # The workers' local batching: "" = AMPD's own (prefill_reorder); another is an ablation.
    batch_policy: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 2:
            raise ValueError(f"gpus must be an integer >= 2 (one prefill and one decode GPU), got {self.gpus!r}")
        if self.sessions not in PRESETS:
            raise ValueError(f"sessions: unknown preset {self.sessions!r}; known: {sorted(PRESETS)}")
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a finite number >= 0 (sessions/s; 0: the default), got {self.rate!r}")
        bad = [n for n in self.tp_degrees if n not in TP_DEGREES]
        if bad or not self.tp_degrees:
            raise ValueError(f"tp_degrees must be a non-empty subset of {list(TP_DEGREES)}, got {list(self.tp_degrees)}")
        if self.top < 1:
            raise ValueError(f"top must be >= 1, got {self.top}")
        if self.sim_sessions < 8:
            raise ValueError(f"sim_sessions must be >= 8, got {self.sim_sessions}")
        if self.batch_policy and self.batch_policy not in known_batch_policies():
            raise ValueError(f"batch_policy must be one of {', '.join(known_batch_policies())} (or empty: AMPD's), "
                             f"got {self.batch_policy!r}")

    @property
    def design(self) -> DesignChoice:
        """What the simulated deployments run: AMPD's placement and its local batching (or the ablation)."""
        return resolve_design("ampd", self.batch_policy)

    def feasible_tps(self) -> list[int]:
        """TP degrees the model fits at (weights and some KV), within the budget."""
        return [n for n in sorted(set(self.tp_degrees)) if n <= self.gpus - 1 and fits_in_memory(self.gpu, self.model, n)]


def _session_means(inputs: PlanInputs) -> tuple[float, float, float, float]:
    spec = PRESETS[inputs.sessions]
    mean_history = (spec.mean_rounds - 1) / 2 * (spec.mean_prefill_tokens + spec.mean_decode_tokens)
    return spec.mean_rounds, spec.mean_prefill_tokens, spec.mean_decode_tokens, mean_history


def step_model(inputs: PlanInputs, tp: int) -> PerfModel:
    """The step-time model of a TP-`tp` replica (measured GPU data or the roofline, per `inputs`)."""
    return perf_model_for(inputs.gpu, inputs.model, tp, **perf_options(inputs), link=inputs.link)


def perf_options(inputs: PlanInputs) -> dict[str, Any]:
    """`inputs`' perf backend as the keyword arguments of `perf_model_for` / `Simulator.from_pools`."""
    return {"backend": inputs.perf_backend, "framework": inputs.perf_framework,
            "database_version": inputs.perf_database_version}


def pool_simulator(inputs: PlanInputs, pools: Sequence[tuple[str, int, int]], **options: Any) -> Simulator:
    """A simulated deployment of `pools` (role, TP, count) as the plan measures it: the whole
    AMPD design (placement and local batching, `inputs.design`), the inputs' GPU, model, link,
    perf backend and SLOs."""
    design = inputs.design
    return Simulator.from_pools(pools, inputs.gpu, inputs.model, link=inputs.link, placement_policy=design.placement,
                                batch_policy=design.batch_policy, slo_ttft_ms=int(inputs.ttft_slo_ms),
                                slo_itl_ms=int(inputs.itl_slo_ms),
                                **{f"perf_{k}": v for k, v in perf_options(inputs).items()}, **options)


def prefill_capacity(inputs: PlanInputs, tp: int) -> float:
    """Sessions/s one TP-`tp` prefill worker computes at the session's mean history, doing nothing else."""
    rounds, new, _, history = _session_means(inputs)
    model = step_model(inputs, tp)
    return 1.0 / (rounds * model.prefill_time(int(history), int(new)))


def session_lifetime_s(inputs: PlanInputs, tp: int) -> float:
    """A session's mean lifetime on a lightly loaded TP-`tp` decode worker (decodes and tool calls)."""
    rounds, new, out, _ = _session_means(inputs)
    model = step_model(inputs, tp)
    return rounds * (out * model.decode_time(16, rounds * (new + out) / 2) + inputs.tool_delay_s)


def decode_capacity(inputs: PlanInputs, tp: int) -> float:
    """Sessions/s one TP-`tp` decode worker can hold: KV tokens over a session's mean resident
    tokens (its history grows to rounds x (prefill + decode)), over its lifetime (Little's law)."""
    rounds, new, out, _ = _session_means(inputs)
    resident = rounds * (new + out) / 2 + new + out
    concurrent = max_kv_tokens(inputs.gpu, inputs.model, tp) / resident
    return concurrent / session_lifetime_s(inputs, tp)


def default_rate(inputs: PlanInputs) -> float:
    """Half of what the budget could prefill with half its GPUs at the most efficient TP degree."""
    tps = inputs.feasible_tps()
    if not tps:
        raise ValueError(f"{inputs.model} fits on no TP degree of {list(inputs.tp_degrees)} x {inputs.gpu} "
                         f"within {inputs.gpus} GPUs")
    per_gpu = max(prefill_capacity(inputs, n) / n for n in tps)
    return 0.5 * (inputs.gpus / 2) * per_gpu


@dataclass(frozen=True)
class LoadCurve:
    """A replica's P95 latency (seconds) at measured per-replica session rates."""

    rates: tuple[float, ...]
    p95_s: tuple[float, ...]  # inf: it did not keep up

    def feasible_points(self, rate: float) -> tuple[np.ndarray, np.ndarray] | None:
        """The points that kept up, made non-decreasing (rates, P95s), or None when `rate` is past
        the last of them (or there is none: no reachable rate was below the replica's limit)."""
        if not self.rates:
            return None
        rates, values = np.asarray(self.rates), np.maximum.accumulate(np.asarray(self.p95_s))
        finite = np.isfinite(values)
        if not finite.any() or rate > rates[finite][-1] * (1 + 1e-9):
            return None
        return rates[finite], values[finite]

    def at(self, rate: float) -> float:
        """P95 at `rate`: the lowest point below the grid, linear between points (made
        non-decreasing), infeasible past the last point that kept up."""
        points = self.feasible_points(rate)
        return INFEASIBLE if points is None else float(np.interp(rate, *points))


def _p95(values: Sequence[float]) -> float:
    return float(np.percentile(values, 95)) if values else INFEASIBLE


# One load-curve point: (side, tp, local share, per-replica session rate). The prefill side
# has one curve per TP (its share is always 0: the rate it gets already excludes local rounds).
PointKey = tuple[str, int, float, float]


def _simulate_point(job: tuple[PlanInputs, PointKey]) -> tuple[float, float]:
    """One load-curve point of one replica: (P95 TTFT, 0) for side "prefill"; for side
    "decode", (P95 mean ITL, P95 TTFT of the rounds it prefilled locally, 0 if none)."""
    inputs, (side, tp, share, rate) = job
    if side == "prefill":
        # Beside TP-8 decode workers with room for every session: a same-TP partner can run
        # out of KV first (a GAIA session's history reaches ~75k tokens, a TP-1 H20 worker's
        # whole KV memory), and the point would measure the decode side, not the prefill.
        partners = max(1, math.ceil(rate / (0.75 * decode_capacity(inputs, PREFILL_HELPER_TP))))
        pools = [("prefill", tp, 1), ("decode", PREFILL_HELPER_TP, partners)]
    else:
        remote_rate = rate * (1 - share)
        helpers = max(1, math.ceil(remote_rate / (0.75 * prefill_capacity(inputs, PREFILL_HELPER_TP))))
        pools = [("prefill", PREFILL_HELPER_TP, helpers), ("decode", tp, 1)]
    sim = pool_simulator(inputs, pools, policy_params={"routing": "share", "local_share": share})
    warmup_s, count = steady_window(inputs, side, tp, share, rate)
    if count is None:  # the replica cannot hold the load at any steady state
        return INFEASIBLE, INFEASIBLE
    sessions = generate_sessions(inputs.sessions, count, np.random.default_rng([inputs.seed, tp]),
                                 tool_delay=ToolDelay("exponential", inputs.tool_delay_s))
    window = count / rate
    outcome = sim.run(sessions, arrivals.poisson(rate), seed=inputs.seed, duration_limit_s=20 * window + 60)
    results = [r for r in outcome.results if r.ok]
    if len(results) < len(outcome.results) * 0.99:
        return INFEASIBLE, INFEASIBLE  # requests still queued when the run was cut: it did not keep up
    steady = steady_rounds(results, warmup_s)
    latency = (lambda r: r.ttft_s) if side == "prefill" else (lambda r: r.tpot_s)
    if grows(steady, latency):  # still rising (or slow to settle near saturation): its later state
        steady = steady[len(steady) // 2:]
    if side == "prefill":
        return _p95([r.ttft_s for r in steady]), 0.0
    local = [r.ttft_s for r in steady if runs_locally(r.request_id, share)]
    return _p95([r.tpot_s for r in steady if r.tpot_s is not None]), _p95(local) if local else 0.0


def loaded_lifetime_s(inputs: PlanInputs, side: str, tp: int, share: float, rate: float) -> float | None:
    """A session's mean lifetime (s) on the replica under test at `rate` sessions/s, or None when no
    steady state exists. Decode side: its running batch B solves B = rate x rounds x out x t(B),
    t = the decode step at B over the mean context, stretched by the share of the worker's time its
    local prefills take (`share` of the rounds); no solution with B within the worker's
    `max_num_seqs`, or local prefills that need the whole worker: None. Prefill side: the decode
    part on an unloaded helper, and each round's prefill queued at utilisation rho (M/D/1's mean wait,
    rho / (2 (1 - rho)) prefills); rho >= 1: None."""
    rounds, new, out, history = _session_means(inputs)
    model = step_model(inputs, tp)
    prefill_s = model.prefill_time(int(history), int(new))
    if side == "prefill":
        rho = prefill_utilisation(inputs, tp, rate)
        if rho >= 1:
            return None
        light = session_lifetime_s(inputs, PREFILL_HELPER_TP)
        return light + rounds * prefill_s * (1 + rho / (2 * (1 - rho)))
    busy_local = share * prefill_utilisation(inputs, tp, rate)  # the worker's time share on local prefills
    if busy_local >= 1:
        return None
    context = int(history + new + out / 2)
    batch = 1.0
    # From B = 1 up, B -> rate x rounds x out x t(B) rises to the smallest fixed point, or escapes
    # past max_num_seqs; no convergence in 100 steps is the edge of stability, counted as none.
    for _ in range(100):
        step_s = model.decode_time(max(1, round(batch)), context) / (1 - busy_local)
        following = rate * rounds * out * step_s
        if following > MAX_NUM_SEQS:
            return None
        if abs(following - batch) <= 0.01 * batch:
            batch = following
            break
        batch = following
    else:
        return None
    step_s = model.decode_time(max(1, round(batch)), context) / (1 - busy_local)
    return rounds * (out * step_s + inputs.tool_delay_s + prefill_s)


def steady_window(inputs: PlanInputs, side: str, tp: int, share: float, rate: float) -> tuple[float, int | None]:
    """(warm-up seconds, sessions to simulate) for one point: a loaded lifetime of arrivals to fill
    the replica, then at least a lifetime and `STEADY_MIN_ROUNDS` rounds measured, at least
    `inputs.sim_sessions` and at most `MAX_POINT_SESSIONS` sessions (then the window is what fits:
    the warm-up at most half of it). (0, None): no steady state (`loaded_lifetime_s`)."""
    lifetime = loaded_lifetime_s(inputs, side, tp, share, rate)
    if lifetime is None:
        return 0.0, None
    rounds = _session_means(inputs)[0]
    measured_s = max(lifetime, STEADY_MIN_ROUNDS / (rate * rounds))
    count = min(MAX_POINT_SESSIONS, max(inputs.sim_sessions, math.ceil(rate * (lifetime + measured_s))))
    return min(lifetime, 0.5 * count / rate), count


def steady_rounds(results: Sequence[Any], warmup_s: float) -> list[Any]:
    """The rounds that arrived after the warm-up and no later than the last session's first round
    (after it, the replica empties), in arrival order."""
    first = [r.arrival_s for r in results if r.round_index == 0]
    if not first:
        return []
    start, end = min(first) + warmup_s, max(first)
    return sorted((r for r in results if start <= r.arrival_s <= end), key=lambda r: r.arrival_s)


def grows(rounds: Sequence[Any], latency: Callable[[Any], float | None], limit: float = GROWTH_LIMIT,
          min_half: int = 20) -> bool:
    """Whether the later half of `rounds` (in arrival order) is `limit` x slower on mean `latency`
    than the earlier half: a queue still rising (or, near saturation, slow to settle), whose later
    state is the one to report."""
    values = [v for v in (latency(r) for r in rounds) if v is not None]
    half = len(values) // 2
    if half < min_half:
        return False
    early, late = float(np.mean(values[:half])), float(np.mean(values[half:]))
    return late > limit * early


def reachable_rates(rate: float, max_count: int) -> list[float]:
    """The per-replica rates a pool of 1..`max_count` replicas sharing `rate` runs at, ascending:
    the only rates the ILP ever reads a curve at."""
    return [rate / count for count in range(max_count, 0, -1)]


def grid_rates(reachable: Sequence[float], limit: float, points: int) -> list[float]:
    """Up to `points` load-curve points among the `reachable` rates (ascending) up to `limit`
    (past it the replica counts as not keeping up): all of them if that few, else the lowest,
    the highest and the rest spread evenly by index between them. Every point is then a rate
    some candidate runs at, where the ILP needs no interpolation."""
    usable = [r for r in reachable if r <= limit * (1 + 1e-9)]
    if len(usable) <= points:
        return usable
    return [usable[i] for i in sorted({round(x) for x in np.linspace(0, len(usable) - 1, points)})]


def initial_points(inputs: PlanInputs, rate: float) -> list[PointKey]:
    """The coarse grid (`grid_rates`): per TP, up to `PREFILL_POINTS` prefill points among the
    reachable rates up to `PREFILL_MAX_LOAD` x its prefill capacity; per TP and local share, up
    to `DECODE_POINTS` decode points up to `DECODE_MAX_LOAD` x what a decode replica can hold —
    its KV memory, and with local prefills also its compute for them (`share` of the rounds
    at its prefill capacity). Per TP also one prefill point nearly idle (`unloaded_rate`)."""
    points: list[PointKey] = []
    for tp in inputs.feasible_tps():
        max_count = (inputs.gpus - 1) // tp
        # One prefill curve per TP, read at the remote rounds' rate x (1 - share) / count.
        reachable = sorted({r for share in LOCAL_SHARES if share < 1
                            for r in reachable_rates(rate * (1 - share), max_count)})
        points += [("prefill", tp, 0.0, r) for r in grid_rates(
            reachable, PREFILL_MAX_LOAD * prefill_capacity(inputs, tp), PREFILL_POINTS)]
        points.append(("prefill", tp, 0.0, unloaded_rate(inputs, tp)))
        for share in LOCAL_SHARES:
            capacity = decode_capacity(inputs, tp)
            if share > 0:
                capacity = min(capacity, prefill_capacity(inputs, tp) / share)
            points += [("decode", tp, share, r) for r in grid_rates(
                reachable_rates(rate, max_count), DECODE_MAX_LOAD * capacity, DECODE_POINTS)]
    return sorted(set(points))


def interpolation_bounds(curve: LoadCurve, rate: float) -> tuple[float, float]:
    """Where the true P95 at `rate` can lie given the measured points: the curve is
    non-decreasing, so between two points it lies between their values, below the first
    point anywhere from 0 to the first value; on a point, at it. (inf, inf) past the last
    point that kept up (infeasible: nothing to interpolate)."""
    points = curve.feasible_points(rate)
    if points is None:
        return INFEASIBLE, INFEASIBLE
    rates, values = points
    above = int(np.searchsorted(rates, rate * (1 - 1e-9)))
    if math.isclose(rates[above], rate, rel_tol=1e-9):
        return float(values[above]), float(values[above])
    return (float(values[above - 1]) if above > 0 else 0.0), float(values[above])


def refinement_points(leading: Sequence[tuple[tuple[int, int, float], tuple[int, int, float]]], rate: float,
                      curves: dict[str, dict[Any, LoadCurve]], ttft_slo_s: float, itl_slo_s: float,
                      tolerance: float = REFINE_TOLERANCE, spread: float = REFINE_SPREAD) -> list[PointKey]:
    """Points at the exact per-replica rates the `leading` (prefill, decode) choices, each
    (tp, count, local share), run at — where the ranking is decided. A side gets its point
    when its interpolation could be off by more than `spread` (relative) and it could bind
    (its upper bound reaches the other side's interpolated cost: a side that does not set Z
    does not reorder the candidates), unless a measured point lies within `tolerance` of the rate."""
    wanted: list[PointKey] = []

    def cost_bounds(shapes: Sequence[tuple[LoadCurve, float]], at: float) -> tuple[float, float, float]:
        """(lower bound, interpolated, upper bound) of the side's cost, P95 / SLO."""
        bounds = [interpolation_bounds(curve, at) for curve, _ in shapes]
        return (max(lo / slo for (lo, _), (_, slo) in zip(bounds, shapes)),
                max(curve.at(at) / slo for curve, slo in shapes),
                max(hi / slo for (_, hi), (_, slo) in zip(bounds, shapes)))

    for (p_tp, p_count, share), (d_tp, d_count, _) in leading:
        sides: list[tuple[PointKey, tuple[float, float]]] = []
        if share < 1:  # no remote rounds: no prefill load, cost 0
            point: PointKey = ("prefill", p_tp, 0.0, rate * (1 - share) / p_count)
            sides.append((point, cost_bounds([(curves["prefill"][p_tp], ttft_slo_s)], point[3])))
        else:
            sides.append((("prefill", p_tp, 0.0, 0.0), (0.0, 0.0, 0.0)))
        point = ("decode", d_tp, share, rate / d_count)
        shapes = [(curves["decode"][(d_tp, share)], itl_slo_s)]
        if share > 0:
            shapes.append((curves["local_ttft"][(d_tp, share)], ttft_slo_s))
        sides.append((point, cost_bounds(shapes, point[3])))
        for (point, (lo, _, hi)), (_, (_, other, _)) in zip(sides, reversed(sides)):
            if hi <= 0 or (hi - lo) / hi <= spread or hi < other:
                continue
            measured = [r for r in curves[point[0]][point[1] if point[0] == "prefill" else point[1:3]].rates]
            measured += [q[3] for q in wanted if q[:3] == point[:3]]
            if all(abs(r - point[3]) > tolerance * point[3] for r in measured):
                wanted.append(point)
    return wanted


def _measure(inputs: PlanInputs, points: Sequence[PointKey], pool: ProcessPoolExecutor | None
             ) -> dict[PointKey, tuple[float, float]]:
    if pool is None:
        return {p: _simulate_point((inputs, p)) for p in points}
    # The costliest points (decode, high rates: the most sessions) first, so the pool ends together.
    order = sorted(points, key=lambda p: (p[0] != "decode", -p[3]))
    values = pool.map(_simulate_point, [(inputs, p) for p in order])  # submitted now, collected below
    import scipy.optimize  # noqa: F401  (the solver's import, ~0.4 s, while the workers simulate)
    return dict(zip(order, values))


def build_curves(measured: dict[PointKey, tuple[float, float]], tps: Sequence[int] = ()
                 ) -> dict[str, dict[Any, LoadCurve]]:
    """The load curves from measured points: "prefill" {tp: P95 TTFT}, "decode" {(tp, share):
    P95 ITL} and "local_ttft" {(tp, share): P95 TTFT of the decode replica's local prefills}."""
    grouped: dict[tuple[str, int, float], list[tuple[float, tuple[float, float]]]] = {}
    for tp in tps:  # a curve for every TP and share, empty where no reachable rate was measurable
        grouped[("prefill", tp, 0.0)] = []
        for share in LOCAL_SHARES:
            grouped[("decode", tp, share)] = []
    for (side, tp, share, rate), values in measured.items():
        grouped.setdefault((side, tp, share), []).append((rate, values))
    curves: dict[str, dict[Any, LoadCurve]] = {"prefill": {}, "decode": {}, "local_ttft": {}}
    for (side, tp, share), points in grouped.items():
        points.sort()
        rates = tuple(r for r, _ in points)
        if side == "prefill":
            curves["prefill"][tp] = LoadCurve(rates, tuple(v[0] for _, v in points))
        else:
            curves["decode"][(tp, share)] = LoadCurve(rates, tuple(v[0] for _, v in points))
            curves["local_ttft"][(tp, share)] = LoadCurve(rates, tuple(v[1] for _, v in points))
    return curves


def cost_tables(inputs: PlanInputs, rate: float, curves: dict[str, dict[Any, LoadCurve]]
                ) -> tuple[dict[tuple[int, int, float], float], dict[tuple[int, int, float], float]]:
    """The ILP's coefficients: for each (tp, count, local share), the prefill pool's P95 TTFT
    over its SLO at rate x (1 - share) / count per replica (its replicas sharing one queue:
    `pooled_prefill_p95`), and the decode pool's larger of
    P95 ITL / ITL SLO and its local prefills' P95 TTFT / TTFT SLO at rate / count."""
    ttft_slo, itl_slo = inputs.ttft_slo_ms / 1000, inputs.itl_slo_ms / 1000
    prefill_cost, decode_cost = {}, {}
    for tp in inputs.feasible_tps():
        for count in range(1, (inputs.gpus - 1) // tp + 1):
            for share in LOCAL_SHARES:
                remote = pooled_prefill_p95(inputs, curves["prefill"][tp], tp, count,
                                            rate * (1 - share) / count) if share < 1 else 0.0
                prefill_cost[(tp, count, share)] = remote / ttft_slo
                itl = curves["decode"][(tp, share)].at(rate / count) / itl_slo
                local = curves["local_ttft"][(tp, share)].at(rate / count) / ttft_slo if share > 0 else 0.0
                decode_cost[(tp, count, share)] = max(itl, local)
    return prefill_cost, decode_cost


def unloaded_rate(inputs: PlanInputs, tp: int) -> float:
    """The per-replica rate of a prefill curve's nearly idle point."""
    return UNLOADED_LOAD * prefill_capacity(inputs, tp)


def prefill_utilisation(inputs: PlanInputs, tp: int, rate: float) -> float:
    """The busy share of a TP-`tp` prefill worker taking every round of `rate` sessions/s."""
    return rate / prefill_capacity(inputs, tp)


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in M/M/`servers` with `offered` = arrival rate x
    service time (Erlang C), by the stable Erlang B recursion; 1 when `offered` >= `servers`."""
    if offered >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return blocking / (1 - offered / servers * (1 - blocking))


def pooled_wait_share(servers: int, utilisation: float) -> float:
    """The mean wait of `servers` replicas sharing one queue, as a share of one replica's alone at
    the same utilisation: C(c, c rho) / (c rho) (M/M/c against M/M/1; 1 for one replica)."""
    if servers <= 1 or not 0 < utilisation < 1:
        return 1.0
    return erlang_c(servers, servers * utilisation) / (servers * utilisation)


def pooled_prefill_p95(inputs: PlanInputs, curve: LoadCurve, tp: int, count: int, rate: float) -> float:
    """P95 TTFT of `count` TP-`tp` prefill replicas at `rate` sessions/s each, sharing their queue
    (AMPD's routing sends a prefill to the cheapest worker with slack): the one-replica curve's
    service part (its nearly idle point) plus its queueing part scaled by `pooled_wait_share`.
    Checked by simulation (DuReader, three TP-4 H200 replicas at utilisation 0.67): one replica
    1,192 ms, idle 279 ms, the pool 483 ms; this gives 482 ms."""
    single = queueing_at(inputs, curve, tp, rate)
    if count <= 1 or not math.isfinite(single):
        return single
    service = curve.at(unloaded_rate(inputs, tp))
    share = pooled_wait_share(count, prefill_utilisation(inputs, tp, rate))
    return service + max(0.0, single - service) * share


def queueing_at(inputs: PlanInputs, curve: LoadCurve, tp: int, rate: float) -> float:
    """A prefill curve read at `rate`, interpolated linearly in rho / (1 - rho) (rho its
    utilisation: a queue's wait grows so) rather than in the rate, which overstates the convex
    curve between two points far apart (HotpotQA, TP-2 H200: 460 ms at rho 0.40, 1,956 ms at
    0.81; at 0.60 linear in the rate says 1,180 ms, this 790 ms). Below and past the points as
    `LoadCurve.at`."""
    points = curve.feasible_points(rate)
    if points is None:
        return INFEASIBLE
    rates, values = points

    def load(r: float) -> float:
        rho = min(prefill_utilisation(inputs, tp, r), 0.999)
        return rho / (1 - rho)

    return float(np.interp(load(rate), [load(r) for r in rates], values))


@dataclass(frozen=True)
class Candidate:
    """A deployment: `prefill_count` workers of TP `prefill_tp`, `decode_count` of TP `decode_tp`,
    with `local_share` of the rounds prefilled on their decode worker (the ILP's routing level)."""

    prefill_tp: int
    prefill_count: int
    decode_tp: int
    decode_count: int
    z: float  # the ILP's objective: max(P95 TTFT / TTFT SLO, P95 ITL / ITL SLO)
    ttft_p95_ms: float  # the larger of the remote and the local prefills' P95 TTFT
    itl_p95_ms: float
    local_share: float = 0.0

    @property
    def gpus(self) -> int:
        return self.prefill_tp * self.prefill_count + self.decode_tp * self.decode_count

    @property
    def label(self) -> str:
        return f"P:<TP={self.prefill_tp}, DP={self.prefill_count}>, D:<TP={self.decode_tp}, DP={self.decode_count}>"


CostKey = tuple  # (tp, count) or (tp, count, local share)


def _share(key: CostKey) -> float:
    return key[2] if len(key) > 2 else 0.0


def solve_plan(prefill_cost: dict[CostKey, float], decode_cost: dict[CostKey, float], gpus: int,
               top: int = 3) -> list[tuple[CostKey, CostKey, float]]:
    """The ILP above over normalised costs {(tp, count[, local share]): P95 / SLO} (finite
    entries only): up to `top` (prefill, decode, Z), best first, each a distinct deployment
    (a deployment at two local shares is one deployment, at its better share). Both sides
    take the same share.

    Solved as one ILP per share, merged: the same optimum as one ILP whose u[n, k, s] and
    v[m, j, s] are linked by Σ u[., ., s] = Σ v[., ., s], about 3x faster for HiGHS at 256
    GPUs. Exact for the runners-up too: if deployment D is among the best `top` at its best
    share s, every deployment ranked above D at share s is ranked above D overall, so D is
    among the best `top` of share s's own ILP."""
    shares = sorted({_share(k) for k in prefill_cost} & {_share(k) for k in decode_cost})
    finite = [v for v in (*prefill_cost.values(), *decode_cost.values()) if math.isfinite(v)]
    scale = max([1.0, *finite])  # one tie-break scale for every level, so their objectives compare
    found: list[tuple[CostKey, CostKey, float]] = []
    for share in shares:
        found += _solve_level({k: v for k, v in prefill_cost.items() if _share(k) == share},
                              {k: v for k, v in decode_cost.items() if _share(k) == share}, gpus, top, scale)
    # Best first by the levels' common objective (Z plus the tie-break terms).
    found.sort(key=lambda f: f[2] + _tie_break(prefill_cost[f[0]] + decode_cost[f[1]],
                                               f[0][0] * f[0][1] + f[1][0] * f[1][1], scale, gpus))
    merged: list[tuple[CostKey, CostKey, float]] = []
    for pre, dec, z in found:
        if all((pre[:2], dec[:2]) != (p[:2], d[:2]) for p, d, _ in merged):
            merged.append((pre, dec, z))
    return merged[:top]


def _tie_break(cost: float | np.ndarray, used_gpus: float | np.ndarray, scale: float, gpus: int):
    """The secondary objective, far below any difference in Z: among deployments bound by the
    same side, the one whose other side is better served (lower sum of both sides' costs),
    and last the one using more of the budget (a GPU left idle serves no one)."""
    return TIE_BREAK * cost / scale - TIE_BREAK / (10 * gpus) * used_gpus


def _solve_level(prefill_cost: dict[CostKey, float], decode_cost: dict[CostKey, float], gpus: int,
                 top: int, scale: float) -> list[tuple[CostKey, CostKey, float]]:
    """Eq. 5 with load-dependent τ at one local share: up to `top` (prefill, decode, Z)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    pre = sorted(k for k, v in prefill_cost.items() if math.isfinite(v) and k[0] * k[1] < gpus)
    dec = sorted(k for k, v in decode_cost.items() if math.isfinite(v) and k[0] * k[1] < gpus)
    if not pre or not dec:
        return []
    n_pre, n_dec = len(pre), len(dec)
    size = n_pre + n_dec + 1  # u..., v..., Z
    # min Z + `_tie_break` (linear in u, v: each side's cost and GPUs).
    c = np.zeros(size)
    c[:-1] = _tie_break(np.array([prefill_cost[k] for k in pre] + [decode_cost[k] for k in dec]),
                        np.array([k[0] * k[1] for k in pre] + [k[0] * k[1] for k in dec], float), scale, gpus)
    c[-1] = 1.0
    rows, lower, upper = [], [], []

    def row(entries: dict[int, float], lo: float, hi: float) -> None:
        r = np.zeros(size)
        for i, v in entries.items():
            r[i] = v
        rows.append(r)
        lower.append(lo)
        upper.append(hi)

    row({i: 1.0 for i in range(n_pre)}, 1, 1)
    row({n_pre + i: 1.0 for i in range(n_dec)}, 1, 1)
    row({**{i: float(k[0] * k[1]) for i, k in enumerate(pre)},
         **{n_pre + i: float(k[0] * k[1]) for i, k in enumerate(dec)}}, 0, gpus)
    row({**{i: -prefill_cost[key] for i, key in enumerate(pre)}, size - 1: 1.0}, 0, np.inf)  # Z >= Σ τ_pre u
    row({**{n_pre + i: -decode_cost[key] for i, key in enumerate(dec)}, size - 1: 1.0}, 0, np.inf)
    integrality = np.ones(size)
    integrality[-1] = 0
    upper_bounds = np.concatenate([np.ones(size - 1), [np.inf]])
    costs = np.array([prefill_cost[k] for k in pre] + [decode_cost[k] for k in dec])
    found: list[tuple[CostKey, CostKey, float]] = []
    for _ in range(top):
        constraints = LinearConstraint(np.array(rows), lower, upper)
        result = milp(c, integrality=integrality, bounds=Bounds(np.zeros(size), upper_bounds),
                      options={"mip_rel_gap": 0}, constraints=constraints)
        if result.status != 0 or result.x is None:
            break
        # Lexicographic: HiGHS stops within an absolute gap of 1e-6, and the tie-break terms are
        # smaller than that (one GPU at 256 weighs ~4e-8), so they are optimised in a second
        # solve of their own, at O(1) scale, among the choices that keep Z at its optimum: every
        # u or v whose own cost exceeds Z* is fixed to 0 (which also makes the solve small).
        z_best = float(result.x[-1])
        allowed = np.concatenate([(costs <= z_best + 1e-9 * max(1.0, z_best)).astype(float), [np.inf]])
        second = milp(np.concatenate([c[:-1] / TIE_BREAK, [0.0]]), integrality=integrality,
                      bounds=Bounds(np.zeros(size), np.minimum(upper_bounds, allowed)),
                      options={"mip_rel_gap": 0}, constraints=constraints)
        if second.status == 0 and second.x is not None:
            result = second
        i = int(np.argmax(result.x[:n_pre]))
        j = int(np.argmax(result.x[n_pre:-1]))
        found.append((pre[i], dec[j], max(prefill_cost[pre[i]], decode_cost[dec[j]])))
        row({i: 1.0, n_pre + j: 1.0}, 0, 1)  # cut this pair off: the next solve finds the runner-up
    return found


@dataclass
class PlanResult:
    inputs: PlanInputs
    rate: float
    candidates: list[Candidate]
    curves: dict[str, dict[Any, LoadCurve]]
    simulate_s: float
    solve_s: float
    simulations: int = 0
    refined: int = 0  # of the simulations, those placed by the refinement pass
    checks: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def name(key: Any) -> str:
            return str(key) if not isinstance(key, tuple) else f"{key[0]}@local{key[1]:g}"
        return {
            "inputs": asdict(self.inputs), "design": self.inputs.design.describe(), "rate": self.rate,
            "candidates": [{**asdict(c), "gpus": c.gpus, "label": c.label} for c in self.candidates],
            "curves": {side: {name(key): {"rates": list(cv.rates), "p95_ms": [v * 1000 for v in cv.p95_s]}
                              for key, cv in per_key.items()} for side, per_key in self.curves.items()},
            "simulate_s": self.simulate_s, "solve_s": self.solve_s, "simulations": self.simulations,
            "refined": self.refined, "checks": self.checks,
        }


def plan(inputs: PlanInputs, processes: int = 2, log: Callable[[str], None] = lambda _: None) -> PlanResult:
    """Measure the coarse load curves, solve, measure the rates the leading candidates run at
    (the refinement pass), solve again with those points in the curves."""
    rate = inputs.rate or default_rate(inputs)
    started = time.perf_counter()
    solve_s = 0.0
    pool = ProcessPoolExecutor(processes) if processes > 1 else None
    try:
        measured = _measure(inputs, initial_points(inputs, rate), pool)
        coarse = len(measured)
        curves = build_curves(measured, inputs.feasible_tps())
        prefill_cost, decode_cost = cost_tables(inputs, rate, curves)
        solving = time.perf_counter()
        leading = solve_plan(prefill_cost, decode_cost, inputs.gpus, inputs.top + REFINE_TOP)
        solve_s += time.perf_counter() - solving
        extra = refinement_points([(p, d) for p, d, _ in leading], rate, curves, inputs.ttft_slo_ms / 1000,
                                  inputs.itl_slo_ms / 1000)
        measured.update(_measure(inputs, extra, pool))
    finally:
        if pool is not None:
            pool.shutdown()
    simulated = time.perf_counter()
    log(f"load curves: {len(measured)} simulations ({coarse} coarse, {len(measured) - coarse} refined) "
        f"in {simulated - started - solve_s:.2f} s")
    solutions = leading[:inputs.top]  # the costs are unchanged without new points
    if extra:
        curves = build_curves(measured, inputs.feasible_tps())
        prefill_cost, decode_cost = cost_tables(inputs, rate, curves)
        solving = time.perf_counter()
        solutions = solve_plan(prefill_cost, decode_cost, inputs.gpus, inputs.top)
        solve_s += time.perf_counter() - solving
    ttft_slo_ms = inputs.ttft_slo_ms
    candidates = []
    for p, d, z in solutions:
        share = _share(p)
        local_ttft = curves["local_ttft"][(d[0], share)].at(rate / d[1]) if share > 0 else 0.0
        ttft_ms = max(prefill_cost[p] * ttft_slo_ms, local_ttft * 1000)
        itl_ms = curves["decode"][(d[0], share)].at(rate / d[1]) * 1000
        candidates.append(Candidate(p[0], p[1], d[0], d[1], z, ttft_ms, itl_ms, share))
    return PlanResult(inputs, rate, candidates, curves, simulated - started - solve_s, solve_s,
                      len(measured), len(measured) - coarse)


def _check_one(job: tuple[PlanInputs, float, Candidate, int]) -> dict[str, Any]:
    inputs, rate, cand, sessions = job
    sim = pool_simulator(inputs, [("prefill", cand.prefill_tp, cand.prefill_count),
                                  ("decode", cand.decode_tp, cand.decode_count)])
    # Measured at steady state as the load curves are: a decode worker's loaded session lifetime
    # of warm-up, then at least two more (a light-load lifetime where that load has none).
    lifetime = (loaded_lifetime_s(inputs, "decode", cand.decode_tp, 0.0, rate / cand.decode_count)
                or session_lifetime_s(inputs, cand.decode_tp))
    sessions = min(CHECK_MAX_SESSIONS, max(sessions, math.ceil(3 * rate * lifetime)))
    items = generate_sessions(inputs.sessions, sessions, np.random.default_rng([inputs.seed, 99]),
                              tool_delay=ToolDelay("exponential", inputs.tool_delay_s))
    outcome = sim.run(items, arrivals.poisson(rate), seed=inputs.seed)
    ttft_s, itl_s = inputs.ttft_slo_ms / 1000, inputs.itl_slo_ms / 1000
    results = steady_rounds(outcome.results, min(lifetime, 0.5 * sessions / rate)) or outcome.results
    met = sum(1 for r in results if r.ok and r.ttft_s <= ttft_s and (r.tpot_s is None or r.tpot_s <= itl_s))
    ok = [r for r in results if r.ok]
    ttft_p95 = _p95([r.ttft_s for r in ok])
    itl_p95 = _p95([r.tpot_s for r in ok if r.tpot_s is not None])
    return {"label": cand.label, "gpus": cand.gpus, "attainment": met / len(results) if results else 0.0,
            "requests": len(results), "sessions": sessions, "ttft_p95_ms": ttft_p95 * 1000, "itl_p95_ms": itl_p95 * 1000,
            "z": max(ttft_p95 / ttft_s, itl_p95 / itl_s),
            "local_share": outcome.stats.incremental_prefills_local
            / max(1, outcome.stats.incremental_prefills_local + outcome.stats.incremental_prefills_remote)}


def rank_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole-cluster results ranked by SLO attainment; a tie in attainment goes to the lower
    simulated Z (the planner's own objective, max of P95 TTFT and ITL over their SLOs)."""
    return sorted(rows, key=lambda row: (-row["attainment"], row["z"], row["planner_rank"]))


def check_plan(result: PlanResult, candidates: Sequence[Candidate], sessions: int = 200,
               processes: int = 2) -> list[dict[str, Any]]:
    """Whole-cluster simulations (the `ampd` policy, adaptive routing) of `candidates` at the
    planned rate, ranked by `rank_checks`, best first. Each simulates at least `sessions`
    sessions, and three loaded session lifetimes of its decode workers' (`CHECK_MAX_SESSIONS` at
    most), and measures the rounds after the first lifetime (`steady_rounds`)."""
    jobs = [(result.inputs, result.rate, cand, sessions) for cand in candidates]
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            rows = list(pool.map(_check_one, jobs))
    else:
        rows = [_check_one(job) for job in jobs]
    for planner_rank, row in enumerate(rows, 1):
        row["planner_rank"] = planner_rank
    return rank_checks(rows)
