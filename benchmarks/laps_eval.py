"""LAPS' evaluation (arXiv 2601.11589 §4) in the simulator: prefill latency and SLO violations.

Step times (`--perf-backend`, default auto): `splitserve.perf.backends.perf_model_for`,
i.e. NVIDIA aiconfigurator's per-kernel timings measured on real GPUs where the GPU x model
is covered (H200 x Qwen2.5 is), a step being the sum of its kernel classes; `datasheet` is
the whole-step roofline (max(compute, memory) per step at datasheet peaks) that timed every
result before issue 34. Every row, the JSON and the printed tables carry the model's
`timing_note` (which backend timed the run).

Deployments (H200):

* **temporal**: 1 prefill instance and 2 decode instances behind it (PD);
* **spatial**: 8 prefill instances and 4 decode instances behind them.

Systems, side by side on the same requests and arrivals:

* **vanilla PD**: `pd_disaggregated`, prefills dispatched round robin over the prefill
  instances (SGLang's data-parallel default), fcfs chunked prefill (2,048-token steps);
* **LB router**: `pd_disaggregated` with least-loaded prefill routing (SGLang-router-like);
* **LAPS**: `laps` placement (short/long pools by L_m, the pressure controller, long
  overflow) + the `laps` local batch policy (short/long apart in time, AWD batching to
  captured shapes, C_l chunks);
* ablations: **pools only** (`laps` placement, fcfs locally) and **batching only**
  (least-loaded PD routing, `laps` locally).

In temporal mode (one prefill instance) the pools do not exist: LAPS is the local policy.

Workloads (`--workloads`): the Mooncake conversation trace (its `hash_ids`: prompts sharing a
prefix hit the prefix cache, the re-prefill history) and the Azure 2023 conversation trace,
request lengths in trace order; `multiturn`: conversations shaped like LAPS' LMsys-Chat-1M
workload (`loadgen.multiturn`, `laps_multiturn.multiturn_workload`: Figure 2's short shares,
spread and turns from the Mooncake trace's shared prefixes, outputs from Azure), each later
turn a re-prefill of its new tokens on the history pinned on the session's decode worker.
Closed-loop clients (concurrency 16 and 64), and Poisson arrivals at load factors 0.4, 0.7
and 1.0 of the prefill instances' raw capacity (instances / the mean (re-)prefill time by
the run's perf model; trace rows without prefix-cache hits, conversation turns as
re-prefills of their new tokens on their history; sessions arrive at that rate / turns per
conversation).

Every request is classified as LAPS classifies it, by its NEW tokens L against L_m(H) on its
history H (`perf_model.prefill_boundary(H)`), never by its whole prompt: a conversation
turn's H is its history, a Mooncake row's the longest prefix it shares with an earlier row
(the best case for a prefix cache), an Azure row's 0. Short and long TTFT are reported apart.
On conversations the baselines run twice: as registered (`pd_disaggregated` ignores the
session binding: a later turn's history is recomputed but for the prefill worker's own
prefix cache) and as `pd_session` (the decode stays on the session's worker and the history's
KV is pulled, as the `laps` placement does), so LAPS' scheduling is not credited with the
history reuse. The physical floor
is reported beside: the share of requests whose prefill alone, on an idle instance without
a prefix-cache hit, already exceeds the TTFT SLO (Mooncake's prompts average 13.7 k tokens). TTFT SLO 0.4 s. Reported: TTFT mean / p90 / p99, SLO violations
(TTFT > 0.4 s or failed), request throughput; the pool controller's moves over time (plot).

Capture effects are not in the simulated times (a padded captured shape costs what the
model says for its real tokens): the simulator shows the scheduling, not CUDA graphs.

A Poisson run offers `--window-s` (60 s) of arrivals, at least `--requests` rows (a trace's
first rows; conversations grow to span the window), and every row says whether it reached a
steady state (`loadgen.probes.steady_state` by the TTFT SLO). Closed loops take the first
`--requests` rows. Before 2026-11-30 a Poisson run was the first 1,000 rows whatever the rate:
a few seconds of Azure's arrivals, a cluster still filling up.

Capacity (`--parts capacity`): per model and workload in spatial mode, the highest Poisson
rate at which a system keeps SLO attainment at 90% of what is attainable (1 − the floor of
the probe's own rows) in a steady run, by `loadgen.metrics.find_capacity`, for vanilla PD,
the LB router and LAPS (the paper's "+35% request throughput" is throughput at an SLO).

Interference (`--parts interference`): LAPS §2, Figures 1 and 3, on one instance (H200 x
Qwen2.5-32B as in the paper): P90 TTFT of long (> 1 K tokens) and short (< 64 tokens)
prefills, each class alone (the figures' dashed lines) and mixed, c clients per class.

    nice -n 5 .venv/bin/python -u benchmarks/laps_eval.py --out-dir bench-results/laps_eval
    nice -n 5 .venv/bin/python -u benchmarks/laps_eval.py --parts capacity --out-dir bench-results/laps_eval
    nice -n 5 .venv/bin/python -u benchmarks/laps_eval.py --workloads multiturn --out-dir bench-results/laps_multiturn
    nice -n 5 .venv/bin/python -u benchmarks/laps_eval.py --parts interference --out-dir bench-results/laps_interf
    .venv/bin/python benchmarks/laps_eval.py --quick --out-dir bench-results/laps_eval_quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads this file by path
from common import REPO  # noqa: E402

import laps_multiturn  # noqa: E402  (registers the pd_session baseline)
from loadgen import arrivals  # noqa: E402
from loadgen.metrics import Slo  # noqa: E402
from loadgen.multiturn import mooncake_turns, rounds_of, split_by_class  # noqa: E402
from loadgen.probes import probe_count, steady_state  # noqa: E402
from loadgen.sessions import parse_tool_delay  # noqa: E402
from loadgen.traces import read_trace  # noqa: E402
from services.planner.sim_workload import SimRequestSpec, requests_from_trace  # noqa: E402
from services.planner.simulator import Simulator, pd_roles  # noqa: E402
from splitserve.perf.backends import BACKENDS  # noqa: E402
from splitserve.perf.model import PerfModel  # noqa: E402

SLO_S = 0.4
# LAPS' SLO is the TTFT alone (§4); `steady_state` judges a run's halves by it.
TTFT_SLO = Slo(ttft_s=SLO_S, itl_s=math.inf)
CAPACITY_SHARE = 0.9  # a capacity keeps attainment >= 90% of the attainable (1 - floor)
TRACES = {"mooncake-conv": "mooncake_conversation_trace.jsonl", "azure-conv": "AzureLLMInferenceTrace_conv.csv"}
MULTITURN = "multiturn"
SESSION_SPAN_S = 30.0  # conversations' first turns arrive over at least this long (Workload.at_rate)
DEPLOYMENTS = {"temporal": (1, 2), "spatial": (8, 4)}  # (prefill instances, decode instances)
SYSTEMS: dict[str, dict[str, Any]] = {
    "vanilla PD": dict(placement_policy="pd_disaggregated", policy_params={"prefill_routing": "round_robin"}),
    "LB router": dict(placement_policy="pd_disaggregated"),
    # LAPS as it ships: Alg. 2 with the donor guard, a check it lacks (no hill-climb move the
    # donor pool cannot spare; on by default since 2026-11-29, docs/laps_measured.md). Runs
    # before then named this "LAPS + donor guard" and the published Alg. 2 "LAPS".
    "LAPS": dict(placement_policy="laps", batch_policy="laps"),
    "LAPS (Alg. 2 as published)": dict(placement_policy="laps", batch_policy="laps",
                                       policy_params={"max_donor_busy": "inf"}),
    "pools only": dict(placement_policy="laps"),
    "batching only": dict(placement_policy="pd_disaggregated", batch_policy="laps"),
    # Conversations only: the baselines keeping the session's history (see the module docstring).
    "vanilla PD (sessions)": dict(placement_policy="pd_session", policy_params={"prefill_routing": "round_robin"}),
    "LB router (sessions)": dict(placement_policy="pd_session"),
}
SESSION_SYSTEMS = ("vanilla PD (sessions)", "LB router (sessions)")
TEMPORAL_SYSTEMS = ("vanilla PD", "LAPS")  # one prefill instance: routing and pools do not apply
BASELINES = ("vanilla PD", "LB router", "vanilla PD (sessions)", "LB router (sessions)")


def decode_instances(model: PerfModel, workload: Workload, deployment: str) -> int:
    """Decode instances of a deployment for a workload. Conversations: enough that the decode
    side is not the bottleneck at the highest load (a conversation's next turn waits for its
    previous turn's last token, so a saturated decode side would throttle the turns and the
    prefill side LAPS schedules would never see the offered load): the prefill instances' raw
    capacity x mean output tokens over 70% of one instance's decode rate at batch 128 and the
    workload's mean context. Trace rows (open loop): the fixed DEPLOYMENTS."""
    n_prefill, n_decode = DEPLOYMENTS[deployment]
    if not workload.sessions:
        return n_decode
    capacity = n_prefill / float(workload.prefill_s(model).mean())
    outputs = [r.output_len for s in workload.items for r in s.rounds]
    mean_out = float(np.mean(outputs))
    context = float(np.mean([h + n for _, _, h, n in workload.rounds])) + mean_out / 2
    per_instance = 128 / model.decode_time(128, context)
    return max(n_decode, math.ceil(capacity * mean_out / (0.7 * per_instance)))


def systems_for(deployment: str, workload: Workload) -> tuple[str, ...]:
    if deployment == "temporal":
        return TEMPORAL_SYSTEMS + (("vanilla PD (sessions)",) if workload.sessions else ())
    return tuple(s for s in SYSTEMS if workload.sessions or s not in SESSION_SYSTEMS)


def system_options(system: str, workload: Workload) -> dict[str, Any]:
    options = dict(SYSTEMS[system])
    if system == "batching only" and workload.sessions:  # LB routing keeping the history, laps locally
        options["placement_policy"] = "pd_session"
    return options


@dataclass
class Workload:
    name: str
    items: list  # SimRequestSpec rows or loadgen Sessions
    # (request id, turn, history H, new tokens L) of every request (a session: every round).
    rounds: list[tuple[str, int, int, int]]
    sessions: bool = False
    source: dict[str, Any] = field(default_factory=dict)
    # Conversations: makes n of them (the same draws for every system at one load point).
    factory: Any = None
    _grown: dict[int, "Workload"] = field(default_factory=dict, repr=False)

    def at_rate(self, rate: float, span_s: float = SESSION_SPAN_S) -> Workload:
        """Conversations at a Poisson rate: enough of them that their first turns arrive over
        `span_s` (a conversation lasts seconds: its turns' decodes and think times; a
        shorter span would measure a burst of first turns, not the steady mix of turns)."""
        if not self.sessions or self.factory is None:
            return self
        n = max(len(self.items), math.ceil(span_s * rate / self.rounds_per_item))
        if n == len(self.items):
            return self
        if n not in self._grown:
            sessions = self.factory(n)
            self._grown[n] = Workload(self.name, sessions, rounds_of(sessions), True, self.source)
        return self._grown[n]

    def first(self, n: int) -> Workload:
        """A trace workload's first `n` rows (a row's history H counts earlier rows only, so a
        prefix of the trace is a workload of its own); conversations as they are."""
        if self.sessions or n >= len(self.items):
            return self
        return Workload(self.name, self.items[:n], self.rounds[:n], False, self.source)

    def for_window(self, rate: float, window_s: float, min_requests: int) -> Workload:
        """What a Poisson run at `rate` offers: arrivals over `window_s`, at least `min_requests`
        (`loadgen.probes.probe_count`). A fixed count would shrink the arrival window as the rate
        grows: 1,000 Azure rows at 135 req/s arrive in 7.4 s, about one request lifetime, and a
        rate the cluster cannot hold passes (docs/laps_measured.md, "Probes that reach a steady
        state"). A trace offers at most all its rows; conversations grow to span the window."""
        if self.sessions:
            return self.at_rate(rate, span_s=window_s)
        return self.first(probe_count(rate, window_s, min_requests))

    @property
    def specs(self) -> list:  # the name the first version used
        return self.items

    @property
    def rounds_per_item(self) -> float:
        return len(self.rounds) / max(1, len(self.items))

    def prefill_s(self, model: PerfModel) -> np.ndarray:
        """Each request's prefill alone on an idle instance: a conversation turn re-prefills its
        new tokens on its history; a trace row is taken without a prefix-cache hit (as before)."""
        if self.sessions:
            return np.array([model.prefill_time(h, n) for _, _, h, n in self.rounds])
        return np.array([model.prefill_time(0, h + n) for _, _, h, n in self.rounds])

    def floor(self, model: PerfModel) -> float:
        """The physical floor: the share of requests whose prefill alone, on an idle instance,
        already exceeds the TTFT SLO."""
        return float((self.prefill_s(model) > SLO_S).mean())

    def classes(self, model: PerfModel) -> dict[str, bool]:
        """request id -> short: new tokens L < L_m(H) (LAPS' class), H as the module docstring says."""
        return split_by_class(self.rounds, model.prefill_boundary)


def trace_rounds(rows, name: str) -> list[tuple[str, int, int, int]]:
    """(id, 0, H, L) per trace row: H the longest prefix (whole blocks) shared with an earlier row."""
    if rows and rows[0].block_tokens:
        turns = mooncake_turns(rows, min_shared_blocks=1)
        return [(f"{name}-{t.index}", 0, t.history, t.new_tokens) for t in turns]
    return [(f"{name}-{i}", 0, 0, r.prompt_len) for i, r in enumerate(rows)]


def load_workloads(trace_dir: Path, n: int | None, log, names: Sequence[str] = tuple(TRACES), conversations: int = 1200,
                   think_time: str = "exponential:mean=1", seed: int = 0) -> list[Workload]:
    out = []
    for name in names:
        if name == MULTITURN:
            missing = [f for f in TRACES.values() if not (trace_dir / f).exists()]
            if missing:
                log(f"skipping {name}: {', '.join(missing)} not in {trace_dir} (pass --trace-dir)")
                continue
            delay = parse_tool_delay(think_time)
            sessions, source = laps_multiturn.multiturn_workload(trace_dir, conversations, seed, delay)

            def factory(count: int, delay=delay) -> list:
                return laps_multiturn.multiturn_workload(trace_dir, count, seed, delay)[0]

            out.append(Workload(name, sessions, rounds_of(sessions), sessions=True, source=source, factory=factory))
            continue
        path = trace_dir / TRACES[name]
        if not path.exists():
            log(f"skipping {name}: {path} not found (pass --trace-dir)")
            continue
        rows = read_trace(path)[:n]
        out.append(Workload(name, requests_from_trace(rows, name), trace_rounds(rows, name)))
    return out


def summarise(results, classes: dict[str, bool] | None = None) -> dict[str, Any]:
    ttft = np.array([r.ttft_s for r in results if r.ok and r.ttft_s is not None])
    violations = sum(1 for r in results if not r.ok or r.ttft_s is None or r.ttft_s > SLO_S)
    done = [r for r in results if r.ok]
    span = max((r.end_s for r in done), default=0.0) - min((r.arrival_s for r in results), default=0.0)
    pct = (lambda q: float(np.percentile(ttft, q) * 1000)) if len(ttft) else (lambda q: float("nan"))
    row = {"requests": len(results), "ok": len(done), "ttft_mean_ms": float(ttft.mean() * 1000) if len(ttft) else None,
           "ttft_p50_ms": pct(50), "ttft_p90_ms": pct(90), "ttft_p99_ms": pct(99),
           "violations": violations, "violation_rate": violations / max(1, len(results)),
           "throughput_rps": len(done) / span if span > 0 else 0.0}
    if classes:
        for name, want in (("short", True), ("long", False)):
            mine = [r for r in results if classes.get(r.request_id) is want]
            t = np.array([r.ttft_s for r in mine if r.ok and r.ttft_s is not None]) * 1000
            bad = sum(1 for r in mine if not r.ok or r.ttft_s is None or r.ttft_s > SLO_S)
            row.update({f"{name}_n": len(mine), f"{name}_ttft_mean_ms": float(t.mean()) if len(t) else None,
                        f"{name}_ttft_p50_ms": float(np.percentile(t, 50)) if len(t) else None,
                        f"{name}_ttft_p90_ms": float(np.percentile(t, 90)) if len(t) else None,
                        f"{name}_violation_rate": bad / len(mine) if mine else None})
    return row


def run_one(gpu: str, model: str, deployment: str, system: str, workload: Workload, load: tuple[str, float],
            seed: int, perf_backend: str = "auto", n_decode: int | None = None) -> dict[str, Any]:
    n_prefill, fixed_decode = DEPLOYMENTS[deployment]
    n_decode = n_decode or fixed_decode
    options = system_options(system, workload)
    sim = Simulator.from_preset(n_prefill + n_decode, gpu, model, roles=pd_roles(n_prefill + n_decode, n_prefill),
                                placement_policy=options["placement_policy"],
                                policy_params=dict(options.get("policy_params", {})),
                                batch_policy=options.get("batch_policy", "fcfs"), slo_ttft_ms=round(SLO_S * 1000),
                                max_num_batched_tokens=2048, perf_backend=perf_backend)
    kind, value = load
    started = time.perf_counter()
    if kind == "rate":
        # A conversation's turns follow its first one: sessions arrive at the rate / turns per conversation.
        workload = workload.at_rate(value)
        outcome = sim.run(workload.items, arrivals.poisson(value / workload.rounds_per_item), seed=seed)
    else:
        outcome = sim.run(workload.items, None, concurrency=int(value), seed=seed)
    model_obj = sim.config.perf_model
    row = summarise(outcome.results, workload.classes(model_obj))
    steady = steady_state(outcome.results, TTFT_SLO)
    row.update(steady=steady.steady, steady_reasons=list(steady.reasons),
               arrival_window_s=steady.arrival_window_s)
    row.update(model=model, deployment=deployment, system=system, workload=workload.name, load=kind, value=value,
               items=len(workload.items), prefill_instances=n_prefill, decode_instances=n_decode, wall_s=time.perf_counter() - started, pool_moves=outcome.stats.pool_moves,
               perf_backend=model_obj.backend, step_times=model_obj.timing_note,
               kv_pulls=outcome.stats.kv_pulls, kv_recomputes=outcome.stats.kv_recomputes)
    if outcome.stats.pool_timeline:
        row["pool_timeline"] = outcome.stats.pool_timeline
    return row


def plan(quick: bool) -> tuple[list[str], list[float], list[int]]:
    models = ["Qwen2.5-14B"] if quick else ["Qwen2.5-14B", "Qwen2.5-32B"]
    factors = [0.7] if quick else [0.4, 0.7, 1.0]
    concurrency = [64] if quick else [16, 64]
    return models, factors, concurrency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results/laps_eval"))
    parser.add_argument("--trace-dir", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--requests", type=int, default=1000,
                        help="Requests of a closed-loop run (the traces' first N), and the fewest of a Poisson run.")
    parser.add_argument("--window-s", type=float, default=60.0,
                        help="Seconds of arrivals a Poisson run offers (at least --requests; a trace offers at "
                             "most all its rows, conversations grow to span it).")
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="One model, one load factor, one concurrency.")
    parser.add_argument("--models", default="", help="Comma list of model presets (default: Qwen2.5-14B and "
                                                     "Qwen2.5-32B; --quick: Qwen2.5-14B).")
    parser.add_argument("--parts", default="sweep",
                        help="Comma list: sweep (the load sweep) | capacity | interference (LAPS Figures 1 and 3).")
    parser.add_argument("--perf-backend", default="auto", choices=BACKENDS,
                        help="What times the steps: auto (measured aiconfigurator data where covered, else the "
                             "kernel-class roofline) | aiconfigurator | roofline | datasheet (the whole-step roofline "
                             "that timed every result before issue 34).")
    parser.add_argument("--workloads", default=",".join(TRACES),
                        help=f"Comma list: {', '.join(TRACES)}, {MULTITURN} (conversations, see the docstring).")
    parser.add_argument("--conversations", type=int, default=1200, help="Conversations of the multiturn workload.")
    parser.add_argument("--think-time", default="exponential:mean=1",
                        help="Between a conversation's turns (loadgen.sessions.parse_tool_delay).")
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"sweep", "capacity", "interference"}:
        raise SystemExit(f"--parts: sweep, capacity and/or interference, got {args.parts!r}")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names or not set(names) <= set(TRACES) | {MULTITURN}:
        raise SystemExit(f"--workloads: a comma list of {', '.join(TRACES)}, {MULTITURN}; got {args.workloads!r}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if "interference" in parts:
        interference_part(args, log)
        if not parts & {"sweep", "capacity"}:
            return
    if args.quick:
        args.requests, args.window_s = 600, 20.0
    if not (args.window_s > 0 and math.isfinite(args.window_s)):
        raise SystemExit(f"--window-s: a number of seconds > 0, got {args.window_s}")
    # Whole traces: a Poisson run takes as many of their first rows as its window needs.
    workloads = load_workloads(args.trace_dir, None, log, names,
                               conversations=400 if args.quick else args.conversations, think_time=args.think_time,
                               seed=args.seed)
    if not workloads:
        raise SystemExit("no trace found: pass --trace-dir (the Mooncake and Azure conversation traces)")
    for workload in workloads:
        if workload.source:
            log(f"{workload.name}: {json.dumps(workload.source['shape'])}")
            log(f"{workload.name}: new tokens {json.dumps(workload.source['generated'])}")
    models, factors, concurrency = plan(args.quick)
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
    if "capacity" in parts:
        capacity_part(args, models, workloads, log)
    if "sweep" not in parts:
        return
    rows = []
    floors: dict[str, float] = {}
    notes: dict[str, str] = {}
    short_shares: dict[str, float] = {}
    started = time.perf_counter()
    for model in models:
        preset = Simulator.from_preset(1, args.gpu, model, perf_backend=args.perf_backend).config.perf_model
        notes[model] = preset.timing_note
        log(f"{model}: {preset.timing_note}; L_m(0) = {preset.prefill_boundary(0):.0f} tokens")
        for deployment, (n_prefill, _) in DEPLOYMENTS.items():
            for whole in workloads:
                workload = whole.first(args.requests)
                systems = systems_for(deployment, workload)
                prefill_s = workload.prefill_s(preset)
                key = f"{model} {workload.name}"
                floors[key] = workload.floor(preset)
                classes = workload.classes(preset)
                short_shares[key] = sum(classes.values()) / max(1, len(classes))
                capacity = n_prefill / float(prefill_s.mean())  # raw prefill capacity, requests (turns) per s
                n_decode = decode_instances(preset, workload, deployment)
                loads = [("rate", round(f * capacity, 3)) for f in factors] + [("concurrency", c) for c in concurrency]
                log(f"{model} {deployment} {workload.name}: {n_prefill} prefill + {n_decode} decode instances, "
                    f"raw prefill capacity {capacity:.1f} req/s, short by L_m(H): {short_shares[key]:.0%}, "
                    f"floor {floors[key]:.1%}")
                for load in loads:
                    offered = whole.for_window(load[1], args.window_s, args.requests) if load[0] == "rate" \
                        else workload
                    for system in systems:
                        row = run_one(args.gpu, model, deployment, system, offered, load, args.seed,
                                      args.perf_backend, n_decode)
                        row["floor_violation_rate"] = floors[key]
                        rows.append(row)
                        log(f"{model:12s} {deployment:8s} {workload.name:13s} {load[0]}={load[1]:<8} {system:21s} "
                            f"TTFT mean {row['ttft_mean_ms']:8.1f} p90 {row['ttft_p90_ms']:8.1f} "
                            f"p99 {row['ttft_p99_ms']:8.1f} ms  short/long p90 {_ms(row.get('short_ttft_p90_ms'))}/"
                            f"{_ms(row.get('long_ttft_p90_ms'))}  viol {row['violation_rate']:6.1%}  "
                            f"{row['throughput_rps']:6.2f} req/s  moves {row['pool_moves']}  [{row['perf_backend']}]"
                            f"  {row['requests']} requests{'' if row['steady'] else ' (not steady)'}"
                            f"  ({row['wall_s']:.1f} s)")
    results = {"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "machine": {"platform": platform.platform(), "python": platform.python_version(),
                           "cpus": os.cpu_count()},
               "gpu": args.gpu, "slo_ttft_s": SLO_S, "requests": args.requests, "window_s": args.window_s,
               "violation_floors": floors,
               "perf_backend": args.perf_backend, "step_times": notes, "short_shares": short_shares,
               "workloads": {w.name: w.source for w in workloads if w.source},
               "wall_s": time.perf_counter() - started}
    (args.out_dir / "laps_eval.json").write_text(json.dumps(results, indent=1))
    comparisons = compare(rows)
    header = "".join(f"{model}: {note}\n\n" for model, note in notes.items())
    (args.out_dir / "laps_eval.md").write_text(header + markdown(rows, comparisons))
    print(header + markdown(rows, comparisons))
    for path in plots(rows, args.out_dir):
        log(f"wrote {path}")


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def interference_part(args: argparse.Namespace, log) -> None:
    """LAPS Figures 1 and 3 on one instance (see laps_multiturn.interference)."""
    result = laps_multiturn.interference(args.gpu, "Qwen2.5-32B", args.perf_backend, seed=args.seed, log=log,
                                         levels=(1, 8, 32) if args.quick else laps_multiturn.INTERFERENCE_LEVELS,
                                         duration_s=30.0 if args.quick else 120.0,
                                         warmup_s=5.0 if args.quick else 10.0)
    result["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    table = laps_multiturn.interference_markdown(result)
    (args.out_dir / "laps_eval_interference.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "laps_eval_interference.md").write_text(table)
    print(table)


CAPACITY_SYSTEMS = ("vanilla PD", "LB router", "LAPS")
# On conversations the baselines keep the session's history, as LAPS does (see the docstring).
SESSION_CAPACITY_SYSTEMS = ("vanilla PD (sessions)", "LB router (sessions)", "LAPS")


def capacity_systems(workload: Workload) -> tuple[str, ...]:
    return SESSION_CAPACITY_SYSTEMS if workload.sessions else CAPACITY_SYSTEMS


def capacity_part(args: argparse.Namespace, models: Sequence[str], workloads: Sequence[Workload], log) -> None:
    """Spatial mode: each system's highest Poisson rate keeping attainment >= 90% of 1 − floor.

    Every probe offers `--window-s` of arrivals (at least `--requests`; `Workload.for_window`)
    and passes only when it reached a steady state (`loadgen.probes.steady_state` by the TTFT
    SLO: arrivals spanning twice the median E2E, the later half's attainment within 10 points
    of the earlier half's); the floor is that probe's own rows'. Before 2026-11-30 every probe
    was the trace's first 1,000 rows whatever the rate."""
    from loadgen.metrics import find_capacity

    rows = []
    n_prefill, _ = DEPLOYMENTS["spatial"]
    for model in models:
        preset = Simulator.from_preset(1, args.gpu, model, perf_backend=args.perf_backend).config.perf_model
        log(f"capacity {model}: {preset.timing_note}")
        for workload in workloads:
            sized = workload.first(args.requests)  # the search's bracket and decode side, as the sweep's
            raw = n_prefill / float(sized.prefill_s(preset).mean())
            n_decode = decode_instances(preset, sized, "spatial")
            for system in capacity_systems(workload):
                probes: list[dict[str, Any]] = []

                def attainment(rate: float) -> float:
                    offered = workload.for_window(rate, args.window_s, args.requests)
                    floor = offered.floor(preset)
                    row = run_one(args.gpu, model, "spatial", system, offered, ("rate", rate), args.seed,
                                  args.perf_backend, n_decode)
                    share = (1 - row["violation_rate"]) / (1 - floor) if floor < 1 else 0.0
                    probes.append(dict(rate=rate, requests=row["requests"], floor=floor,
                                       attainment=1 - row["violation_rate"], of_attainable=share,
                                       steady=row["steady"], steady_reasons=row["steady_reasons"],
                                       arrival_window_s=row["arrival_window_s"], wall_s=row["wall_s"]))
                    log(f"  probe {system:21s} {rate:8.2f} req/s  {row['requests']:6d} requests over "
                        f"{row['arrival_window_s']:6.1f} s  attainment {1 - row['violation_rate']:6.1%} "
                        f"({share:6.1%} of attainable)  {'steady' if row['steady'] else '; '.join(row['steady_reasons'])}"
                        f"  ({row['wall_s']:.1f} s)")
                    return share if row["steady"] else 0.0

                found = find_capacity(attainment, CAPACITY_SHARE, lo=0.25 * raw, hi=raw, tol=0.02 * raw,
                                      max_iters=12)
                floors = [p["floor"] for p in probes]
                rows.append(dict(model=model, workload=workload.name, system=system, target=CAPACITY_SHARE,
                                 floor=float(np.mean(floors)), capacity_rps=found.rate, probes=probes,
                                 window_s=args.window_s, min_requests=args.requests,
                                 perf_backend=preset.backend, step_times=preset.timing_note))
                log(f"capacity {model:12s} {workload.name:13s} {system:21s} {found.rate:8.2f} req/s "
                    f"(attainment >= {CAPACITY_SHARE:.0%} of 1 - floor, {len(found.probes)} probes)")
    lines = ["| model | workload | floor (mean over probes) | vanilla PD | LB router | LAPS | LAPS vs PD / router |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model in models:
        for workload in workloads:
            got = {r["system"]: r for r in rows if (r["model"], r["workload"]) == (model, workload.name)}
            pd, lb, laps = (got[s]["capacity_rps"] for s in capacity_systems(workload))
            label = f"{workload.name} (baselines keep sessions)" if workload.sessions else workload.name
            lines.append(f"| {model} | {label} | {got['LAPS']['floor']:.1%} | {pd:.2f} | {lb:.2f} | "
                         f"{laps:.2f} | {_pct(laps / pd - 1 if pd else None)} / {_pct(laps / lb - 1 if lb else None)} |")
    notes = sorted({r["step_times"] for r in rows})
    table = "".join(f"{n}\n\n" for n in notes) + "\n".join(lines) + "\n"
    (args.out_dir / "laps_eval_capacity.json").write_text(json.dumps(
        {"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
         "perf_backend": args.perf_backend, "step_times": notes, "window_s": args.window_s,
         "min_requests": args.requests, "target": f"attainment >= {CAPACITY_SHARE:.0%} of 1 - floor"}, indent=1))
    (args.out_dir / "laps_eval_capacity.md").write_text(table)
    print(table)


def compare(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """LAPS against each baseline per (model, deployment, workload, load): relative changes."""
    keyed = {(r["model"], r["deployment"], r["workload"], r["load"], r["value"], r["system"]): r for r in rows}
    out = []
    for (model, deployment, workload, load, value, system), laps in keyed.items():
        if system != "LAPS":
            continue
        for baseline in BASELINES:
            base = keyed.get((model, deployment, workload, load, value, baseline))
            if base is None:
                continue

            def change(key: str) -> float | None:
                b, v = base.get(key), laps.get(key)
                return None if not b or v is None else v / b - 1

            out.append(dict(model=model, deployment=deployment, workload=workload, load=load, value=value,
                            baseline=baseline, ttft_mean=change("ttft_mean_ms"), ttft_p90=change("ttft_p90_ms"),
                            short_p90=change("short_ttft_p90_ms"), long_p90=change("long_ttft_p90_ms"),
                            violations=(laps["violations"] - base["violations"]) / base["violations"]
                            if base["violations"] else None,
                            throughput=change("throughput_rps")))
    return out


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.0%}"


def markdown(rows: Sequence[dict[str, Any]], comparisons: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | deployment | workload | load | system | TTFT mean / p90 / p99 ms | short / long TTFT p90 ms "
             "(short share) | SLO violations (floor) | req/s | pool moves | timed by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = r["short_n"] / max(1, r["short_n"] + r["long_n"]) if "short_n" in r else None
        lines.append(f"| {r['model']} | {r['deployment']} | {r['workload']} | {r['load']} {r['value']} | "
                     f"{r['system']} | {r['ttft_mean_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{_ms(r.get('short_ttft_p90_ms'))} / {_ms(r.get('long_ttft_p90_ms'))}"
                     f"{f' ({share:.0%})' if share is not None else ''} | "
                     f"{r['violation_rate']:.1%} ({r.get('floor_violation_rate', 0):.0%}) | {r['throughput_rps']:.2f} | "
                     f"{r['pool_moves']} | {r.get('perf_backend', '?')} |")
    lines += ["", "| model | deployment | workload | load | LAPS vs | TTFT mean | TTFT p90 | short p90 | long p90 | "
              "SLO violations | req/s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in comparisons:
        lines.append(f"| {c['model']} | {c['deployment']} | {c['workload']} | {c['load']} {c['value']} | "
                     f"{c['baseline']} | {_pct(c['ttft_mean'])} | {_pct(c['ttft_p90'])} | {_pct(c.get('short_p90'))} | "
                     f"{_pct(c.get('long_p90'))} | {_pct(c['violations'])} | {_pct(c['throughput'])} |")
    return "\n".join(lines) + "\n"


def plots(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rate_rows = [r for r in rows if r["load"] == "rate"]
    groups = sorted({(r["model"], r["deployment"], r["workload"]) for r in rate_rows})
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
        for ax, (model, deployment, workload) in zip(axes[0], groups):
            for system in SYSTEMS:
                points = sorted((r["value"], r["ttft_p90_ms"]) for r in rate_rows if (r["model"], r["deployment"],
                                r["workload"], r["system"]) == (model, deployment, workload, system))
                if points:
                    ax.plot(*zip(*points), marker="o", label=system)
            ax.set_title(f"{model}\n{deployment}, {workload}", fontsize=8)
            ax.set_xlabel("Poisson rate (req/s)")
            ax.set_ylabel("TTFT p90 (ms)")
            ax.set_yscale("log")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "laps_eval_ttft_p90.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    timed = [r for r in rows if r.get("pool_timeline") and r["system"] == "LAPS" and r["deployment"] == "spatial"]
    if timed:
        busiest = max(timed, key=lambda r: (r["pool_moves"], r["value"] if r["load"] == "rate" else 0))
        t, p_s, p_l, n_s, n_l = np.array(busiest["pool_timeline"]).T
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 4.5), sharex=True)
        top.step(t, n_s, where="post", label="short pool")
        top.step(t, n_l, where="post", label="long pool")
        top.set_ylabel("instances")
        top.legend(fontsize=7)
        top.set_title(f"pool controller: {busiest['model']}, {busiest['workload']}, {busiest['load']} "
                      f"{busiest['value']} ({busiest['pool_moves']} moves)", fontsize=9)
        bottom.plot(t, p_s, label="P_s (P90 of ψ)")
        bottom.plot(t, p_l, label="P_l")
        bottom.set_xlabel("virtual time (s)")
        bottom.set_ylabel("pool pressure")
        bottom.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / "laps_eval_controller.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    main()
