"""AMPD against its baselines on a real cluster, sessions through the gateway (issue 13).

The simulator's evaluation (`benchmarks/ampd_eval.py`) says which system should win; this
runs the comparison through the real services as a user would: `start_cluster` launches
Redis, the global scheduler, the coordinator, the gateway and the workers, and
`splitserve bench --sessions toolbench` (a separate process, streaming through the gRPC
gateway) opens Poisson-arriving multi-round sessions with exponential tool calls between
rounds. Per system and session rate: SLO attainment, TTFT of first and later rounds, the
request p99 inter-token gap, throughput; and from the workers' own counters, how much
history KV was pulled (remote incremental prefills, AMPD §3), how much of it the prefill
worker found in its own prefix cache instead, and how much KV was pushed.

Two modes:

* ``--mode emulated`` (default): H20 × Qwen3-32B emulated workers (the real worker service,
  engine scheduler, block manager, session pins and KV reservations; each forward pass
  sleeps the preset's time), ToolBench sessions, SLO TTFT ≤ 350 ms / ITL ≤ 40 ms (the
  paper's), each system on the 8-GPU deployment `ampd_eval.py` found best for it.
* ``--mode real``: three CPU workers running the real SmolLM2-135M-Instruct, ToolBench
  sessions with lengths scaled down, SLOs scaled to this machine. A direction check only:
  every worker shares the same two cores, so disaggregation cannot add compute here.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/ampd_cluster.py --out-dir bench-results/ampd_cluster
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.dynaserve_cluster import model_dir, run_bench  # noqa: E402
from splitserve.cli.launcher import ClusterSpec, start_cluster  # noqa: E402
from splitserve.redis_server import free_port  # noqa: E402

console = Console(stderr=True, width=200)


@dataclass(frozen=True)
class System:
    """One serving system: placement policy, deployment and what its workers run."""

    name: str
    policy: str
    workers: int
    prefill_workers: int = 0
    tp: int = 1
    batch_policy: str = "fcfs"
    policy_params: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Mode:
    """The cluster and load of one mode."""

    rates: tuple[float, ...]
    sessions: int
    slo_ttft_ms: float
    slo_itl_ms: float
    length_scale: float
    tool_delay: str
    worker_args: dict
    systems: tuple[System, ...]


def emulated_mode(args) -> Mode:
    def perf(tp: int) -> dict[str, str]:
        return {"perf_model": f"H20/qwen3-32b/{tp}"}

    # The best 8-GPU deployment of each system in ampd_eval.py's ToolBench panel.
    systems = (
        System("AMPD", "ampd", 2, 1, tp=4, batch_policy="prefill_reorder", policy_params=perf(4)),
        System("Dynamo-like (pd_disaggregated)", "pd_disaggregated", 4, 3, tp=2),
        System("vLLM-like (least_loaded)", "least_loaded", 1, tp=8),
        System("vLLM-Continuum-like (session_affinity)", "session_affinity", 1, tp=8),
    )
    return Mode(rates=tuple(args.rates or (0.63, 1.57)), sessions=args.sessions or 40, slo_ttft_ms=350,
                slo_itl_ms=40, length_scale=1.0, tool_delay="exponential:mean=1",
                worker_args={"backend": "emulated", "gpu": "H20", "model_preset": "qwen3-32b",
                             "max_model_len": 32768, "max_num_seqs": 256, "max_num_batched_tokens": 2048},
                systems=systems)


def real_mode(args) -> Mode:
    systems = (
        System("AMPD", "ampd", 3, 1, batch_policy="prefill_reorder"),
        System("Dynamo-like (pd_disaggregated)", "pd_disaggregated", 3, 1),
        System("vLLM-like (least_loaded)", "least_loaded", 3),
        System("vLLM-Continuum-like (session_affinity)", "session_affinity", 3),
    )
    return Mode(rates=tuple(args.rates or (0.15, 0.3)), sessions=args.sessions or 12, slo_ttft_ms=args.real_ttft_ms,
                slo_itl_ms=args.real_itl_ms, length_scale=0.25, tool_delay="exponential:mean=1",
                worker_args={"backend": "real", "max_num_seqs": 16, "kv_cache_memory_bytes": 128 << 20,
                             "max_num_batched_tokens": 512},
                systems=systems)


def _worker_counter(cluster, name: str, labels: str = "") -> float:
    """A counter summed over the cluster's workers, from their /metrics."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
    for child in cluster.children:
        if child.name.startswith("worker") and child.metrics_port:
            match = pattern.search(httpx.get(f"http://127.0.0.1:{child.metrics_port}/metrics", timeout=5).text)
            total += float(match.group(1)) if match else 0.0
    return total


def _kv_counters(cluster) -> dict[str, float]:
    return {"kv_pulled_tokens": _worker_counter(cluster, "splitserve_worker_kv_incoming_tokens_total", '{how="pulled"}'),
            "kv_pushed_tokens": _worker_counter(cluster, "splitserve_worker_kv_incoming_tokens_total", '{how="pushed"}'),
            "history_cached_tokens": _worker_counter(cluster, "splitserve_worker_history_cached_tokens_total")}


def run_system(system: System, mode: Mode, model_path: Path, args, out_dir: Path) -> list[dict]:
    worker_args = {**mode.worker_args, "batch_policy": system.batch_policy}
    if mode.worker_args.get("backend") == "emulated":
        worker_args["tp"] = system.tp
    spec = ClusterSpec(
        model=str(model_path), workers=system.workers, policy=system.policy, prefill_workers=system.prefill_workers,
        http_port=free_port(), grpc_port=free_port(), redis_url=args.redis_url,
        redis_prefix=f"ss:ampdbench-{uuid.uuid4().hex[:8]}:", log_dir=out_dir / "logs" / system.policy,
        worker_args=worker_args, scheduler_args={"policy_params": json.dumps(system.policy_params)},
        coordinator_args={"kv_chunk_tokens": 256})
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cluster = start_cluster(spec)
    startup_s = time.monotonic() - started
    rows = []
    try:
        for index, rate in enumerate(mode.rates):
            run_dir = out_dir / f"{system.policy}-{rate:g}"
            # Each rate its own sessions (the same for every system): rerunning the previous
            # rate's prompts on this cluster would hit its prefix cache and flatter later rates.
            seed = args.seed + index
            before = _kv_counters(cluster)
            summary = run_bench(cluster.gateway_grpc, [
                "--sessions", "toolbench", "--num-sessions", str(mode.sessions), "--length-scale",
                str(mode.length_scale), "--tool-delay", mode.tool_delay, "--arrival", f"poisson:rate={rate}",
                "--seed", str(seed), "--slo-ttft-ms", str(mode.slo_ttft_ms), "--slo-itl-ms", str(mode.slo_itl_ms),
            ], run_dir, args.run_timeout_s, f"{system.name} at {rate:g} sessions/s")
            after = _kv_counters(cluster)
            rows.append({"system": system.name, "policy": system.policy, "workers": system.workers,
                         "prefill_workers": system.prefill_workers, "tp": system.tp,
                         "batch_policy": system.batch_policy, "rate": rate, "seed": seed, "startup_s": startup_s,
                         **_pick(summary), **{k: after[k] - before[k] for k in after}})
    finally:
        cluster.stop()
    return rows


EMULATED_COUNTERS = ("steps", "model_seconds", "overhead_seconds", "late_seconds", "lost_seconds", "overrun_steps")


def _emulated_counters(cluster) -> dict[str, dict[str, float]]:
    """Each worker's pacing counters (`splitserve_emulated_*_total`, workers/engine/emulated.py)."""
    out = {}
    for child in cluster.children:
        if child.name.startswith("worker") and child.metrics_port:
            text = httpx.get(f"http://127.0.0.1:{child.metrics_port}/metrics", timeout=5).text
            values = {}
            for name in EMULATED_COUNTERS:
                match = re.search(rf"^splitserve_emulated_{name}_total (\S+)$", text, re.M)
                values[name] = float(match.group(1)) if match else 0.0
            out[child.name] = values
    return out


def faithfulness(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """How faithfully the emulated workers kept the model's timeline over a run: per worker and
    in all, the time steps fell behind it and never made up (`lost`) and the wake-up lateness,
    over the model time; and the share of steps whose control-plane work alone overran the step."""
    per_worker = {}
    for name, end in after.items():
        start = before.get(name, {})
        d = {k: end[k] - start.get(k, 0.0) for k in end}
        per_worker[name] = {"steps": d["steps"], "model_s": d["model_seconds"], "lost_s": d["lost_seconds"],
                            "late_s": d["late_seconds"], "overhead_s": d["overhead_seconds"],
                            "overruns": d["overrun_steps"],
                            "lost_share": d["lost_seconds"] / d["model_seconds"] if d["model_seconds"] else 0.0}
    model = sum(w["model_s"] for w in per_worker.values())
    steps = sum(w["steps"] for w in per_worker.values())
    return {"workers": per_worker, "model_s": model, "steps": steps,
            "lost_share": sum(w["lost_s"] for w in per_worker.values()) / model if model else 0.0,
            "late_share": sum(w["late_s"] for w in per_worker.values()) / model if model else 0.0,
            "overrun_share": sum(w["overruns"] for w in per_worker.values()) / steps if steps else 0.0,
            "worst_lost_share": max((w["lost_share"] for w in per_worker.values()), default=0.0)}


@contextmanager
def decode_pool_tp(tp: int | None):
    """Start decode workers at TP `tp` while the launcher gives every worker the same options
    (a deployment whose prefill and decode pools differ in TP): the worker command is rewritten
    for role=decode only. Restored on exit."""
    from splitserve.cli import launcher

    original = launcher._serve_cmd

    def serve_cmd(service: str, options: dict[str, object]) -> list[str]:
        if tp is not None and service == "worker" and options.get("role") == "decode":
            options = {**options, "tp": tp}
        return original(service, options)

    launcher._serve_cmd = serve_cmd
    try:
        yield
    finally:
        launcher._serve_cmd = original


def run_emulated_deployment(*, gpu: str, model_preset: str, perf_backend: str, prefill_tp: int, prefill_count: int,
                            decode_tp: int, decode_count: int, rate: float, sessions: int, seed: int,
                            slo_ttft_ms: float, slo_itl_ms: float, out_dir: Path, redis_url: str,
                            policy: str = "ampd", batch_policy: str = "fcfs", timeout_s: float = 900.0,
                            preset: str = "toolbench", tool_delay: str = "exponential:mean=1") -> dict[str, Any]:
    """One deployment (prefill_count x TP prefill_tp prefill workers, decode_count x TP decode_tp
    decode workers) of emulated `gpu` x `model_preset` workers behind the real services, `sessions`
    `preset` sessions at `rate` through the gateway: per-request results (`--per-request`), the
    bench summary and the workers' pacing (`faithfulness`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        model_path = model_dir("emulated", Path(work), max_model_len=32768)
        worker_args = {"backend": "emulated", "gpu": gpu, "model_preset": model_preset, "perf_backend": perf_backend,
                       "tp": prefill_tp, "max_model_len": 32768, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
                       "batch_policy": batch_policy}
        params = {"perf_model": f"{perf_backend}:{gpu}/{model_preset}/{prefill_tp}"} if policy == "ampd" else {}
        spec = ClusterSpec(
            model=str(model_path), workers=prefill_count + decode_count, policy=policy, prefill_workers=prefill_count,
            http_port=free_port(), grpc_port=free_port(), redis_url=redis_url,
            redis_prefix=f"ss:ampdplan-{uuid.uuid4().hex[:8]}:", log_dir=out_dir / "logs", worker_args=worker_args,
            scheduler_args={"policy_params": json.dumps(params)}, coordinator_args={"kv_chunk_tokens": 256})
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with decode_pool_tp(decode_tp):
            cluster = start_cluster(spec)
        startup_s = time.monotonic() - started
        try:
            before = _emulated_counters(cluster)
            run_dir = out_dir / "bench"
            started = time.monotonic()
            summary = run_bench(cluster.gateway_grpc, [
                "--sessions", preset, "--num-sessions", str(sessions), "--tool-delay", tool_delay,
                "--arrival", f"poisson:rate={rate}", "--seed", str(seed), "--slo-ttft-ms", str(slo_ttft_ms),
                "--slo-itl-ms", str(slo_itl_ms), "--per-request"], run_dir, timeout_s,
                f"emulated P:TP{prefill_tp}x{prefill_count} D:TP{decode_tp}x{decode_count} at {rate:g} sessions/s")
            bench_s = time.monotonic() - started
            pacing = faithfulness(before, _emulated_counters(cluster))
        finally:
            cluster.stop()
    record = json.loads(sorted(run_dir.glob("*.json"))[0].read_text())
    return {"summary": summary, "requests": record.get("requests", []), "faithfulness": pacing,
            "startup_s": startup_s, "bench_s": bench_s}


def _pick(summary: dict) -> dict:
    def ms(name: str, key: str) -> float | None:
        dist = summary.get(name)
        return None if not dist or dist.get(key) is None else dist[key] * 1000

    return {"requests": summary["n_requests"], "failed": summary["n_failed"],
            "attainment": summary["slo_attainment"], "throughput_tok_s": summary["output_token_throughput"],
            "ttft_initial_p50_ms": ms("ttft_initial", "p50"), "ttft_incremental_p50_ms": ms("ttft_incremental", "p50"),
            "ttft_p99_ms": ms("ttft", "p99"), "tbt_p99_p50_ms": ms("tbt_p99", "p50")}


def _table(rows: list[dict], title: str) -> Table:
    table = Table("system", "deployment", "rate", "attainment", "TTFT p50 first / later rounds ms", "TTFT p99 ms",
                  "request p99 TBT p50 ms", "tok/s", "history pulled / cached / KV pushed tokens", "failed",
                  title=title)

    def ms(value):
        return "-" if value is None else f"{value:,.0f}"

    for r in rows:
        deployment = (f"{r['prefill_workers']}P+{r['workers'] - r['prefill_workers']}D" if r["prefill_workers"]
                      else f"{r['workers']} colocated") + (f", TP{r['tp']}" if r["tp"] > 1 else "")
        table.add_row(r["system"], deployment, f"{r['rate']:g}", f"{r['attainment']:.0%}",
                      f"{ms(r['ttft_initial_p50_ms'])} / {ms(r['ttft_incremental_p50_ms'])}", ms(r["ttft_p99_ms"]),
                      ms(r["tbt_p99_p50_ms"]), f"{r['throughput_tok_s']:,.0f}",
                      f"{r['kv_pulled_tokens']:,.0f} / {r['history_cached_tokens']:,.0f} / {r['kv_pushed_tokens']:,.0f}",
                      str(r["failed"]))
    return table


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == name]
        ax.plot([r["rate"] for r in mine], [r["attainment"] * 100 for r in mine], marker="o", label=name)
    ax.set(xlabel="session arrival rate (sessions/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("emulated", "real"), default="emulated")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], help="comma list of sessions/s")
    ap.add_argument("--sessions", type=int, help="sessions per run (default: emulated 40, real 12)")
    ap.add_argument("--real-ttft-ms", type=float, default=3000.0, help="real mode: TTFT objective (ms)")
    ap.add_argument("--real-itl-ms", type=float, default=300.0, help="real mode: ITL objective (ms)")
    ap.add_argument("--systems", default="", help="comma list of policies to run (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="sessions of the i-th rate: seed + i")
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "ampd_cluster")
    args = ap.parse_args()
    mode = emulated_mode(args) if args.mode == "emulated" else real_mode(args)
    out_dir = args.out_dir / args.mode
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {name.strip() for name in args.systems.split(",") if name.strip()}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        model_path = model_dir(args.mode, Path(work), max_model_len=32768)
        for system in mode.systems:
            if not wanted or system.policy in wanted:
                rows += run_system(system, mode, model_path, args, out_dir)
    what = "8 x H20 emulated, Qwen3-32B" if args.mode == "emulated" else "3 CPU workers, SmolLM2-135M"
    title = (f"ToolBench sessions, {what}, SLO TTFT <= {mode.slo_ttft_ms:g} ms, p99 TBT <= {mode.slo_itl_ms:g} ms")
    console.print(_table(rows, title))
    record = {"benchmark": "ampd_cluster", "mode": args.mode, "command": " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "sessions_per_run": mode.sessions, "length_scale": mode.length_scale, "tool_delay": mode.tool_delay,
              "slo_ttft_ms": mode.slo_ttft_ms, "slo_itl_ms": mode.slo_itl_ms, "rows": rows,
              "finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out_dir / "ampd_cluster.json").write_text(json.dumps(record, indent=2))
    _plot(rows, out_dir / "ampd_cluster.png", title)
    console.print(f"wrote {out_dir / 'ampd_cluster.json'} and {out_dir / 'ampd_cluster.png'}")


if __name__ == "__main__":
    main()
