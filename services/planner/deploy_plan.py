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

**Where τ comes from** (Appendix A.1: the simulator). A replica's latency depends only on
its own load, so each is a *load curve* over the per-replica session rate, measured once
per TP degree by simulating one replica with the real core (`Simulator`, the `ampd` policy
with remote prefills, the session preset's lengths and tool delays): a prefill replica
beside a decode worker (TTFT P95), a decode replica fed by enough TP-8 prefill workers
that its prefill never queues (ITL P95, the per-request mean gap). Rates between measured
points are interpolated (the curve is made non-decreasing); past the highest rate a
replica keeps up with, it is infeasible. The number of simulations is fixed per TP degree,
so the plan's cost does not grow with N: at 256 GPUs the ILP has ~1,000 binaries and
solves in milliseconds, and the simulations take the rest.

`check_plan` simulates the top configurations as whole clusters at the planned rate and
ranks them by SLO attainment (the paper's Table 2: planner vs real serving).
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
from services.planner.simulator import Simulator
from splitserve.perf_presets import TP_DEGREES, fits_in_memory, max_kv_tokens, preset

__all__ = ["PlanInputs", "LoadCurve", "Candidate", "solve_plan", "plan", "check_plan", "default_rate",
           "prefill_capacity"]

INFEASIBLE = math.inf
TIE_BREAK = 1e-4  # weight of the secondary objective (see solve_plan)
PREFILL_LOADS = (0.2, 0.45, 0.7, 0.9)  # per-replica rate as a share of its prefill capacity
DECODE_LOADS = (0.2, 0.5, 0.85)  # ... of its KV-memory capacity for pinned sessions
MAX_DECODE_SESSIONS = 150  # a decode point simulates ~2 session lifetimes of arrivals, at most this many
PREFILL_HELPER_TP = 8  # the fastest prefill workers feed the decode replica under test


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
    tool_delay_s: float = 1.0
    sim_sessions: int = 48  # sessions per load-curve point (the curve's resolution vs the plan's time)
    seed: int = 0
    top: int = 3

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

    def feasible_tps(self) -> list[int]:
        """TP degrees the model fits at (weights and some KV), within the budget."""
        return [n for n in sorted(set(self.tp_degrees)) if n <= self.gpus - 1 and fits_in_memory(self.gpu, self.model, n)]


def _session_means(inputs: PlanInputs) -> tuple[float, float, float, float]:
    spec = PRESETS[inputs.sessions]
    mean_history = (spec.mean_rounds - 1) / 2 * (spec.mean_prefill_tokens + spec.mean_decode_tokens)
    return spec.mean_rounds, spec.mean_prefill_tokens, spec.mean_decode_tokens, mean_history


def prefill_capacity(inputs: PlanInputs, tp: int) -> float:
    """Sessions/s one TP-`tp` prefill worker computes at the session's mean history, doing nothing else."""
    rounds, new, _, history = _session_means(inputs)
    model = preset(inputs.gpu, inputs.model, tp, link=inputs.link)
    return 1.0 / (rounds * model.prefill_time(int(history), int(new)))


def session_lifetime_s(inputs: PlanInputs, tp: int) -> float:
    """A session's mean lifetime on a lightly loaded TP-`tp` decode worker (decodes and tool calls)."""
    rounds, new, out, _ = _session_means(inputs)
    model = preset(inputs.gpu, inputs.model, tp, link=inputs.link)
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

    def at(self, rate: float) -> float:
        """P95 at `rate`: the lowest point below the grid, linear between points (made
        non-decreasing), infeasible past the last point that kept up."""
        rates, values = np.asarray(self.rates), np.maximum.accumulate(np.asarray(self.p95_s))
        finite = np.isfinite(values)
        if not finite.any() or rate > rates[finite][-1] * (1 + 1e-9):
            return INFEASIBLE
        return float(np.interp(rate, rates[finite], values[finite]))


def _p95(values: Sequence[float]) -> float:
    return float(np.percentile(values, 95)) if values else INFEASIBLE


def _simulate_point(job: tuple[str, PlanInputs, int, float]) -> float:
    """One load-curve point: P95 TTFT (side "prefill") or P95 mean ITL ("decode") of one replica."""
    side, inputs, tp, rate = job
    if side == "prefill":
        pools = [("prefill", tp, 1), ("decode", tp, 1)]
    else:
        helpers = max(1, math.ceil(rate / (0.75 * prefill_capacity(inputs, PREFILL_HELPER_TP))))
        pools = [("prefill", PREFILL_HELPER_TP, helpers), ("decode", tp, 1)]
    sim = Simulator.from_pools(pools, inputs.gpu, inputs.model, link=inputs.link, placement_policy="ampd",
                               policy_params={"routing": "remote"}, slo_ttft_ms=int(inputs.ttft_slo_ms),
                               slo_itl_ms=int(inputs.itl_slo_ms))
    count = inputs.sim_sessions
    if side == "decode":  # enough arrivals for the worker to fill up to its steady-state session count
        count = max(count, min(MAX_DECODE_SESSIONS, math.ceil(2 * rate * session_lifetime_s(inputs, tp))))
    sessions = generate_sessions(inputs.sessions, count, np.random.default_rng([inputs.seed, tp]),
                                 tool_delay=ToolDelay("exponential", inputs.tool_delay_s))
    window = count / rate
    outcome = sim.run(sessions, arrivals.poisson(rate), seed=inputs.seed, duration_limit_s=20 * window + 60)
    results = [r for r in outcome.results if r.ok]
    if len(results) < len(outcome.results) * 0.99:
        return INFEASIBLE  # requests still queued when the run was cut: it did not keep up
    if side == "prefill":
        return _p95([r.ttft_s for r in results])
    return _p95([r.tpot_s for r in results if r.tpot_s is not None])


def measure_curves(inputs: PlanInputs, processes: int = 2) -> dict[str, dict[int, LoadCurve]]:
    """Each side's load curve at each feasible TP degree (`PREFILL_LOADS`, `DECODE_LOADS`)."""
    jobs: list[tuple[str, PlanInputs, int, float]] = []
    for tp in inputs.feasible_tps():
        jobs += [("prefill", inputs, tp, load * prefill_capacity(inputs, tp)) for load in PREFILL_LOADS]
        jobs += [("decode", inputs, tp, load * decode_capacity(inputs, tp)) for load in DECODE_LOADS]
    if processes > 1:
        # The costliest points (decode, high rates: the most sessions) first, so the pool ends together.
        order = sorted(range(len(jobs)), key=lambda i: (jobs[i][0] != "decode", -jobs[i][3]))
        with ProcessPoolExecutor(processes) as pool:
            done = dict(zip(order, pool.map(_simulate_point, [jobs[i] for i in order])))
        values = [done[i] for i in range(len(jobs))]
    else:
        values = [_simulate_point(job) for job in jobs]
    curves: dict[str, dict[int, LoadCurve]] = {"prefill": {}, "decode": {}}
    for side in curves:
        for tp in inputs.feasible_tps():
            points = sorted((job[3], v) for job, v in zip(jobs, values) if job[0] == side and job[2] == tp)
            curves[side][tp] = LoadCurve(tuple(r for r, _ in points), tuple(v for _, v in points))
    return curves


@dataclass(frozen=True)
class Candidate:
    """A deployment: `prefill_count` workers of TP `prefill_tp`, `decode_count` of TP `decode_tp`."""

    prefill_tp: int
    prefill_count: int
    decode_tp: int
    decode_count: int
    z: float  # the ILP's objective: max(P95 TTFT / TTFT SLO, P95 ITL / ITL SLO)
    ttft_p95_ms: float
    itl_p95_ms: float

    @property
    def gpus(self) -> int:
        return self.prefill_tp * self.prefill_count + self.decode_tp * self.decode_count

    @property
    def label(self) -> str:
        return f"P:<TP={self.prefill_tp}, DP={self.prefill_count}>, D:<TP={self.decode_tp}, DP={self.decode_count}>"


def solve_plan(prefill_cost: dict[tuple[int, int], float], decode_cost: dict[tuple[int, int], float], gpus: int,
               top: int = 3) -> list[tuple[tuple[int, int], tuple[int, int], float]]:
    """The ILP above over normalised costs {(tp, count): P95 / SLO} (finite entries only): up
    to `top` (prefill, decode, Z), best first, each later one with the earlier cut off."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    pre = sorted(k for k, v in prefill_cost.items() if math.isfinite(v) and k[0] * k[1] < gpus)
    dec = sorted(k for k, v in decode_cost.items() if math.isfinite(v) and k[0] * k[1] < gpus)
    if not pre or not dec:
        return []
    n_pre, n_dec = len(pre), len(dec)
    size = n_pre + n_dec + 1  # u..., v..., Z
    # min Z, then (a tie-break far below any difference in Z) the sum of both sides' costs:
    # among deployments bound by the same side, the one whose other side is better served.
    c = np.concatenate([[prefill_cost[k] for k in pre], [decode_cost[k] for k in dec], [0.0]])
    c *= TIE_BREAK / max(1.0, float(c.max()))
    # ... and last, the budget used: a worker more serves AMPD's local prefills, which the
    # curves (remote prefills only) do not see.
    c[:-1] -= TIE_BREAK / (10 * gpus) * np.array([tp * k for tp, k in pre] + [tp * k for tp, k in dec], float)
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
    row({**{i: float(tp * k) for i, (tp, k) in enumerate(pre)},
         **{n_pre + i: float(tp * k) for i, (tp, k) in enumerate(dec)}}, 0, gpus)
    row({**{i: -prefill_cost[key] for i, key in enumerate(pre)}, size - 1: 1.0}, 0, np.inf)  # Z >= Σ τ_pre u
    row({**{n_pre + i: -decode_cost[key] for i, key in enumerate(dec)}, size - 1: 1.0}, 0, np.inf)
    integrality = np.ones(size)
    integrality[-1] = 0
    bounds = Bounds(np.zeros(size), np.concatenate([np.ones(size - 1), [np.inf]]))
    found: list[tuple[tuple[int, int], tuple[int, int], float]] = []
    for _ in range(top):
        result = milp(c, integrality=integrality, bounds=bounds,
                      constraints=LinearConstraint(np.array(rows), lower, upper))
        if result.status != 0 or result.x is None:
            break
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
    curves: dict[str, dict[int, LoadCurve]]
    simulate_s: float
    solve_s: float
    checks: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": asdict(self.inputs), "rate": self.rate,
            "candidates": [{**asdict(c), "gpus": c.gpus, "label": c.label} for c in self.candidates],
            "curves": {side: {str(tp): {"rates": list(cv.rates), "p95_ms": [v * 1000 for v in cv.p95_s]}
                              for tp, cv in per_tp.items()} for side, per_tp in self.curves.items()},
            "simulate_s": self.simulate_s, "solve_s": self.solve_s, "checks": self.checks,
        }


def plan(inputs: PlanInputs, processes: int = 2, log: Callable[[str], None] = lambda _: None) -> PlanResult:
    """Measure the load curves, fill the ILP's coefficients for every (TP, count) and solve it."""
    rate = inputs.rate or default_rate(inputs)
    started = time.perf_counter()
    curves = measure_curves(inputs, processes)
    simulated = time.perf_counter()
    log(f"load curves: {sum(len(c.rates) for side in curves.values() for c in side.values())} simulations "
        f"in {simulated - started:.2f} s")
    ttft_slo, itl_slo = inputs.ttft_slo_ms / 1000, inputs.itl_slo_ms / 1000
    prefill_cost, decode_cost = {}, {}
    for tp in inputs.feasible_tps():
        for count in range(1, (inputs.gpus - 1) // tp + 1):
            prefill_cost[(tp, count)] = curves["prefill"][tp].at(rate / count) / ttft_slo
            decode_cost[(tp, count)] = curves["decode"][tp].at(rate / count) / itl_slo
    solutions = solve_plan(prefill_cost, decode_cost, inputs.gpus, inputs.top)
    solved = time.perf_counter()
    candidates = [Candidate(p[0], p[1], d[0], d[1], z, prefill_cost[p] * inputs.ttft_slo_ms,
                            decode_cost[d] * inputs.itl_slo_ms) for p, d, z in solutions]
    return PlanResult(inputs, rate, candidates, curves, simulated - started, solved - simulated)


def _check_one(job: tuple[PlanInputs, float, Candidate, int]) -> dict[str, Any]:
    inputs, rate, cand, sessions = job
    sim = Simulator.from_pools([("prefill", cand.prefill_tp, cand.prefill_count),
                                ("decode", cand.decode_tp, cand.decode_count)], inputs.gpu, inputs.model,
                               link=inputs.link, placement_policy="ampd", slo_ttft_ms=int(inputs.ttft_slo_ms),
                               slo_itl_ms=int(inputs.itl_slo_ms))
    items = generate_sessions(inputs.sessions, sessions, np.random.default_rng([inputs.seed, 99]),
                              tool_delay=ToolDelay("exponential", inputs.tool_delay_s))
    outcome = sim.run(items, arrivals.poisson(rate), seed=inputs.seed)
    ttft_s, itl_s = inputs.ttft_slo_ms / 1000, inputs.itl_slo_ms / 1000
    results = outcome.results
    met = sum(1 for r in results if r.ok and r.ttft_s <= ttft_s and (r.tpot_s is None or r.tpot_s <= itl_s))
    return {"label": cand.label, "gpus": cand.gpus, "attainment": met / len(results) if results else 0.0,
            "requests": len(results)}


def check_plan(result: PlanResult, candidates: Sequence[Candidate], sessions: int = 200,
               processes: int = 2) -> list[dict[str, Any]]:
    """Whole-cluster simulations (the `ampd` policy, adaptive routing) of `candidates` at the
    planned rate, ranked by SLO attainment, best first (ties: the planner's order)."""
    jobs = [(result.inputs, result.rate, cand, sessions) for cand in candidates]
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            rows = list(pool.map(_check_one, jobs))
    else:
        rows = [_check_one(job) for job in jobs]
    for planner_rank, row in enumerate(rows, 1):
        row["planner_rank"] = planner_rank
    return sorted(rows, key=lambda row: (-row["attainment"], row["planner_rank"]))
