"""Helpers of benchmarks/laps_eval.py for multi-turn traffic and LAPS' §2 interference figures.

* `PdSessionPolicy` (registered as `pd_session`): `pd_disaggregated` whose decode stage stays on
  the session's bound decode worker, so a later turn's prefill reuses the history's KV (the
  remote prefill pulls it, AMPD's lazy pull) exactly as the `laps` placement does. The
  registered `pd_disaggregated` ignores `bound_worker`: every later turn re-binds the session
  to the least-loaded decode worker and its history is recomputed (only a prefill worker's
  own prefix cache still holds the previous prompt, not its output). Comparing LAPS against
  it alone would credit LAPS with the history reuse, not with its scheduling; the
  evaluation runs both kinds of baseline.
* `multiturn_workload`: conversations shaped like LAPS' LMsys-Chat-1M workload
  (`loadgen.multiturn`), spread and turns from the Mooncake trace, outputs from Azure.
* `ClassClosedLoop`: the simulator's closed loop with one client pool per request class (a
  finished long request's client sends another long one): LAPS Figures 1 and 3, "varying
  concurrency levels for long and short requests" on one instance.
* `interference`: TTFT of long (> 1 K tokens) and short (< 64 tokens) prefills, alone and
  mixed, at rising concurrency, on one H200 x Qwen2.5-32B (the paper's setup), fcfs chunked
  prefill and LAPS' local policy.
"""

from __future__ import annotations

import time
from collections import deque
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from loadgen.multiturn import (ConversationShape, generate_conversations, mooncake_turn_stats, mooncake_turns,
                               new_token_stats, rounds_of)
from loadgen.sessions import ToolDelay
from loadgen.traces import read_trace
from services.global_scheduler.disaggregated import PdDisaggregatedPolicy, two_stage
from services.global_scheduler.policy import ClusterView, Placement, PlacementRequest, register_policy
from services.planner import sim_run
from services.planner.sim_workload import SimRequestSpec
from services.planner.simulator import Simulator

__all__ = ["PdSessionPolicy", "ClassClosedLoop", "multiturn_workload", "interference", "INTERFERENCE_LEVELS"]


class PdSessionPolicy(PdDisaggregatedPolicy):
    """`pd_disaggregated` (round robin or least loaded prefill) keeping a session's decode on
    its bound decode worker: later turns re-prefill only their new tokens."""

    name = "pd_session"

    def place(self, request: PlacementRequest, view: ClusterView, now: float) -> Placement:
        placement = super().place(request, view, now)
        if not request.bound_worker or len(placement.stages) != 2:
            return placement
        bound = next((w for w in view.by_role("decode") if w.worker_id == request.bound_worker), None)
        prefill = next((w for w in view.by_role("prefill") if w.worker_id == placement.stages[0].worker_id), None)
        if bound is None or prefill is None or bound.worker_id == placement.stages[1].worker_id:
            return placement
        return two_stage(prefill, bound, request.prompt_len, request, self.name,
                         f"prefill on {prefill.worker_id}, decode on the session's {bound.worker_id}")


register_policy("pd_session", PdSessionPolicy)


@lru_cache(maxsize=8)
def conversation_shape(trace_dir: Path, think_time: ToolDelay) -> tuple[ConversationShape, dict[str, Any]]:
    """The conversations' shape from the traces (see `loadgen.multiturn`) and the Mooncake turns' stats."""
    mooncake = read_trace(trace_dir / "mooncake_conversation_trace.jsonl")
    stats = mooncake_turn_stats(mooncake_turns(mooncake))
    outputs = tuple(r.output_len for r in read_trace(trace_dir / "AzureLLMInferenceTrace_conv.csv"))
    shape = ConversationShape(sigma=round(stats["later_sigma_iqr"], 3), turns=tuple(stats["turns_per_conversation"]),
                              outputs=outputs, think_time=think_time)
    return shape, {k: v for k, v in stats.items() if k != "turns_per_conversation"}


def multiturn_workload(trace_dir: Path, conversations: int, seed: int = 0,
                       think_time: ToolDelay | None = None) -> tuple[list, dict[str, Any]]:
    """The conversations (sessions) and what they were built from (see `loadgen.multiturn`)."""
    shape, mooncake = conversation_shape(Path(trace_dir), think_time or ToolDelay())
    sessions = generate_conversations(shape, conversations, np.random.default_rng([seed, 34]))
    source = {"shape": shape.describe(), "generated": new_token_stats(sessions), "mooncake": mooncake,
              "paper_figure2": {"first_below_256": 0.63, "later_below_256": 0.81}}
    return sessions, source


# ---- LAPS Figures 1 and 3 -----------------------------------------------------------------

class ClassClosedLoop(sim_run.SimRun):
    """Closed loop with one client pool per class: `clients[cls]` clients each send a request
    of `make[cls](n)` as soon as their previous one ended, until `duration_s`."""

    def __init__(self, config, clients: dict[str, int], make: dict[str, Callable[[int], SimRequestSpec]],
                 duration_s: float):
        total = sum(clients.values())
        if total < 1:
            raise ValueError("clients: need at least one")
        super().__init__(config, [None] * total, None, concurrency=total, duration_limit_s=duration_s)
        self._make = make
        self._classes = deque(cls for cls, n in clients.items() for _ in range(n))
        self._sent = 0

    def _next_closed_loop_item(self) -> None:
        if self._closing or not self._classes:
            return
        cls = self._classes.popleft()
        spec = self._make[cls](self._sent)
        self._sent += 1
        self._push(self.now, sim_run._SEND, (sim_run._Item(spec), 0))

    def _end(self, request, result) -> None:
        super()._end(request, result)
        self._classes.append(request.request_id.split("-", 1)[0])  # the client sends its class again


INTERFERENCE_LEVELS = (1, 2, 4, 8, 16, 32, 64)
FIXED_LONG = 4  # long clients of the second Figure-1 view (short clients rising beside them)


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q)) if len(values) else float("nan")


def interference(gpu: str = "H200", model: str = "Qwen2.5-32B", perf_backend: str = "auto",
                 levels: Sequence[int] = INTERFERENCE_LEVELS, duration_s: float = 60.0, warmup_s: float = 5.0,
                 budget: int = 2048, long_range: tuple[int, int] = (1025, 4096), short_range: tuple[int, int] = (8, 63),
                 seed: int = 0, log=print) -> dict[str, Any]:
    """TTFT of long and short prefills alone and mixed (c long + c short clients), one instance,
    prefill only (one output token: TTFT is the prefill's end), per local batch policy."""
    rng = np.random.default_rng([seed, 1])
    longs = rng.integers(long_range[0], long_range[1] + 1, size=1 << 16)
    shorts = rng.integers(short_range[0], short_range[1] + 1, size=1 << 16)
    make = {"long": lambda n: SimRequestSpec(f"long-{n}", int(longs[n % len(longs)]), 1),
            "short": lambda n: SimRequestSpec(f"short-{n}", int(shorts[n % len(shorts)]), 1)}
    rows = []
    note = ""
    for policy in ("fcfs", "laps"):
        sim = Simulator.from_preset(1, gpu, model, perf_backend=perf_backend, placement_policy="least_loaded",
                                    batch_policy=policy, slo_ttft_ms=400, max_num_batched_tokens=budget)
        note = sim.config.perf_model.timing_note
        for c in levels:
            mixes = {"mixed": {"long": c, "short": c}}
            if policy == "fcfs":  # the dashed lines: one class alone; and a fixed long load under rising shorts
                mixes = {"long alone": {"long": c}, "short alone": {"short": c}, **mixes,
                         f"long {FIXED_LONG} + short": {"long": FIXED_LONG, "short": c}}
            for mix, clients in mixes.items():
                started = time.perf_counter()
                run = ClassClosedLoop(sim.config, clients, make, duration_s)
                results = run.execute()
                kept = [r for r in results if r.ok and r.arrival_s >= warmup_s and r.ttft_s is not None]
                ttft = {cls: [r.ttft_s for r in kept if r.request_id.startswith(cls + "-")] for cls in ("long", "short")}
                row = dict(policy=policy, concurrency=c, mix=mix, wall_s=time.perf_counter() - started,
                           steps=run.stats.steps)
                for cls, values in ttft.items():
                    if clients.get(cls):
                        row.update({f"{cls}_n": len(values), f"{cls}_p50_ms": _p(values, 50),
                                    f"{cls}_p90_ms": _p(values, 90),
                                    f"{cls}_rps": len(values) / (duration_s - warmup_s)})
                rows.append(row)
                log(f"interference {perf_backend:9s} {policy:5s} c={c:<3d} {mix:12s} "
                    + "  ".join(f"{cls} p90 {row[f'{cls}_p90_ms']:8.1f} ms (n={row[f'{cls}_n']})"
                                for cls in ("long", "short") if f"{cls}_n" in row)
                    + f"  ({row['wall_s']:.1f} s)")
    return {"gpu": gpu, "model": model, "perf_backend": perf_backend, "step_times": note, "budget": budget,
            "long_range": list(long_range), "short_range": list(short_range), "duration_s": duration_s,
            "warmup_s": warmup_s, "rows": rows}


def _fmt(row: dict[str, Any] | None, key: str) -> str:
    value = row.get(key) if row else None
    if value is None:
        return "–"
    if value != value:  # nan: none of the class's requests sent after the warm-up finished in the window
        return "none finished"
    return f"{value:.0f} ms"


def interference_markdown(result: dict[str, Any]) -> str:
    """Figure 1 (long P90 alone vs mixed) and Figure 3 (short P90 alone vs mixed), per concurrency."""
    get = {(r["policy"], r["concurrency"], r["mix"]): r for r in result["rows"]}
    lines = [f"{result['step_times']}; {result['model']} on one {result['gpu']}, {result['budget']}-token steps, "
             f"long {result['long_range'][0]}-{result['long_range'][1]} tokens, short {result['short_range'][0]}-"
             f"{result['short_range'][1]} tokens, one output token, {result['duration_s']:g} s per point "
             f"(first {result['warmup_s']:g} s dropped)", "",
             "| clients per class | long P90 alone (Fig. 1 dashed) | long P90 mixed, fcfs | long: mixed / alone | "
             "short P90 alone (Fig. 3 dashed) | short P90 mixed, fcfs | short: mixed / alone | "
             "short P90 mixed, LAPS | long P90 mixed, LAPS | long req/s mixed, fcfs / LAPS |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    levels = sorted({r["concurrency"] for r in result["rows"]})
    for c in levels:
        la, mx, sa = get.get(("fcfs", c, "long alone")), get.get(("fcfs", c, "mixed")), get.get(("fcfs", c, "short alone"))
        lp = get.get(("laps", c, "mixed"))
        if not (la and mx and sa):
            continue
        lines.append(f"| {c} | {la['long_p90_ms']:.0f} ms | {mx['long_p90_ms']:.0f} ms | "
                     f"{mx['long_p90_ms'] / la['long_p90_ms']:.2f}x | {sa['short_p90_ms']:.0f} ms | "
                     f"{mx['short_p90_ms']:.0f} ms | {mx['short_p90_ms'] / sa['short_p90_ms']:.2f}x | "
                     f"{_fmt(lp, 'short_p90_ms')} | {_fmt(lp, 'long_p90_ms')} | "
                     f"{mx.get('long_rps', 0):.2f} / {lp.get('long_rps', 0) if lp else 0:.2f} |")
    base = get.get(("fcfs", FIXED_LONG, "long alone"))
    fixed = [(c, get.get(("fcfs", c, f"long {FIXED_LONG} + short"))) for c in levels]
    if base and any(r for _, r in fixed):
        lines += ["", f"Long P90 with {FIXED_LONG} long clients and c short clients beside them (fcfs; "
                      f"{FIXED_LONG} long clients alone: {base['long_p90_ms']:.0f} ms):", "",
                  "| short clients | long P90 | vs long alone | short P90 |", "| --- | --- | --- | --- |"]
        for c, r in fixed:
            if r:
                lines.append(f"| {c} | {r['long_p90_ms']:.0f} ms | {r['long_p90_ms'] / base['long_p90_ms']:.2f}x | "
                             f"{r['short_p90_ms']:.0f} ms |")
    return "\n".join(lines) + "\n"


def rounds_table(sessions) -> list[tuple[str, int, int, int]]:
    """Re-exported for laps_eval: (request id, turn, H, L) of every round."""
    return rounds_of(sessions)
