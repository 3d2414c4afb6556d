"""Emulated cluster scale: the most emulated workers this machine runs with control-plane overhead < 5%.

For each worker count, `start_cluster` launches the real control plane (gateway, coordinator,
global scheduler, Redis) and N emulated workers (`--backend emulated`: the real worker
service, engine scheduler and block manager; each forward pass sleeps the performance
model's time for its batch). A closed-loop SDK client keeps `streams_per_worker x N`
streaming requests in flight (distinct random prompts, `ignore_eos`). After a warm-up, one
measurement window yields:

- per-step control-plane overhead: the wall time each worker spends between emulated
  forward passes (post-processing, engine loop, scheduling), which the pacer subtracts
  from its sleep, as a fraction of the model's step time (worker Prometheus metrics
  `splitserve_emulated_*`, summed over workers), with the p99 of one step's overhead and
  the engine thread's own CPU time in it (the rest is GIL and CPU contention);
- lost time: how far emulated steps ran past the model's timeline without making it up
  (overruns, wake-ups later than the pacer's catch-up), i.e. the emulated step slowdown;
- end-to-end ITL inflation: the client's mean inter-token time over complete requests vs
  the model's token-weighted decode step time (`decode_model_seconds / decode_tokens`);
- throughput, per-worker RSS, cluster start-up time and the CPU cores each part used.

A worker count is sustained when both the overhead fraction and the ITL inflation are under
`--threshold` (5%). The machine may be shared: other processes' CPU use during the window
is reported (`background_cores`), and with `--repeats` each worker count runs several
times and the run with the least background load is the one reported (all are in the JSON).

    .venv/bin/python benchmarks/emulated_cluster.py --workers 4,8,16,32 --out bench-results/emulated_cluster.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from splitserve.client import AsyncClient  # noqa: E402
from splitserve.cli.launcher import Cluster, ClusterSpec, start_cluster  # noqa: E402
from splitserve.perf.presets import preset  # noqa: E402
from splitserve.redis_server import free_port  # noqa: E402

console = Console(stderr=True, width=220)
CLK_TCK = os.sysconf("SC_CLK_TCK")
COUNTERS = ("steps_total", "model_seconds_total", "overhead_seconds_total", "overhead_cpu_seconds_total",
            "late_seconds_total", "lost_seconds_total", "overrun_steps_total", "decode_tokens_total",
            "decode_model_seconds_total")
HISTOGRAMS = ("step_overhead_seconds", "step_late_seconds")


# ---- measurements ---------------------------------------------------------------------------

def _scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name in COUNTERS:
        m = re.search(rf"^splitserve_emulated_{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    for name in HISTOGRAMS:
        for le, value in re.findall(rf'^splitserve_emulated_{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
            out[f"{name}:{le}"] = float(value)
    return out


def _scrape_workers(cluster: Cluster) -> dict[str, float]:
    total: dict[str, float] = {}
    for child in cluster.children:
        if child.name.startswith("worker-"):
            for key, value in _scrape(child.metrics_port).items():
                total[key] = total.get(key, 0.0) + value
    return total


def _bucket_quantile(delta: dict[str, float], name: str, q: float) -> float:
    """Upper bound of the q-quantile from cumulative Prometheus buckets (seconds)."""
    buckets = sorted(((float(k.split(":", 1)[1]), v) for k, v in delta.items() if k.startswith(name + ":")),
                     key=lambda kv: kv[0])
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    target = q * buckets[-1][1]
    return next(le for le, count in buckets if count >= target)


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy_seconds() -> float:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / CLK_TCK


def _rss_mb(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else 0.0


def _cpu_by_part(cluster: Cluster) -> dict[str, float]:
    parts = {"workers": 0.0, "gateway": 0.0, "coordinator": 0.0, "scheduler": 0.0,
             "client": _cpu_seconds(os.getpid())}
    for child in cluster.children:
        key = "workers" if child.name.startswith("worker-") else child.name
        parts[key] = parts.get(key, 0.0) + _cpu_seconds(child.process.pid)
    parts["machine"] = _machine_busy_seconds()
    return parts


# ---- load ---------------------------------------------------------------------------------------

@dataclass
class RequestTrace:
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)


async def _closed_loop(target: str, concurrency: int, prompt_len: int, max_tokens: int, warmup_s: float,
                       duration_s: float, on_window) -> tuple[list[RequestTrace], float, float, int]:
    """`concurrency` users, each streaming requests back to back; `on_window(phase)` is called
    at the window's start and end. Returns (traces, window start, window end, errors)."""
    traces: list[RequestTrace] = []
    errors = 0
    stop_at = [float("inf")]
    rng = random.Random(0)

    async def user(client: AsyncClient, u: int) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at[0]:
            prompt = [rng.randrange(0, 256) for _ in range(prompt_len)]  # distinct: no prefix-cache hits
            trace = RequestTrace()
            try:
                async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.8,
                                                 seed=rng.randrange(1 << 31), ignore_eos=True):
                    if not chunk.token_ids:
                        continue
                    now = time.perf_counter()
                    if trace.tokens:
                        trace.gaps.append(now - trace.last)
                    else:
                        trace.first = now
                    trace.last = now
                    trace.tokens += len(chunk.token_ids)
            except Exception as err:  # counted, not fatal: the report shows them
                errors += 1
                console.print(f"[yellow]request failed: {err}[/yellow]")
                await asyncio.sleep(0.1)
                continue
            traces.append(trace)

    async with AsyncClient(target, timeout_s=300) as client:
        tasks = [asyncio.create_task(user(client, u)) for u in range(concurrency)]
        await asyncio.sleep(warmup_s)
        start = time.perf_counter()
        await asyncio.to_thread(on_window, "start")
        await asyncio.sleep(duration_s)
        end = time.perf_counter()
        await asyncio.to_thread(on_window, "end")
        stop_at[0] = end
        await asyncio.gather(*tasks)
    return traces, start, end, errors


# ---- one worker count ----------------------------------------------------------------------

def run_one(args, n: int, model_dir: Path) -> dict:
    perf = preset(args.gpu, args.model_preset, args.tp)
    spec = ClusterSpec(
        model=str(model_dir), workers=n, policy=args.policy, http_port=free_port(), grpc_port=free_port(),
        redis_url=args.redis_url, redis_prefix=f"ss:emubench-{uuid.uuid4().hex[:8]}:",
        log_dir=args.log_dir / f"n{n}",
        worker_args={"backend": "emulated", "gpu": args.gpu, "model_preset": args.model_preset, "tp": args.tp,
                     "max_num_seqs": args.max_num_seqs},
        gateway_args={"max_concurrent_requests": max(256, 2 * n * args.streams_per_worker),
                      "max_tokens_limit": max(4096, args.max_tokens)},
    )
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):  # free_port() can race with other processes on a busy box: retry
        console.print(f"[bold]{n} workers[/bold]: starting ...")
        t0 = time.perf_counter()
        try:
            cluster = start_cluster(spec, ready_timeout_s=600)
            break
        except (RuntimeError, TimeoutError) as err:
            console.print(f"[yellow]cluster start failed ({str(err).splitlines()[0]}); retrying[/yellow]")
            spec.http_port, spec.grpc_port = free_port(), free_port()
            spec.redis_prefix = f"ss:emubench-{uuid.uuid4().hex[:8]}:"
    else:
        raise RuntimeError(f"{n} workers: the cluster did not start in 3 attempts")
    startup_s = time.perf_counter() - t0
    try:
        worker_pids = [c.process.pid for c in cluster.children if c.name.startswith("worker-")]
        rss = [_rss_mb(pid) for pid in worker_pids]
        snaps: dict[str, tuple[dict, dict, float]] = {}

        def on_window(phase: str) -> None:
            snaps[phase] = (_scrape_workers(cluster), _cpu_by_part(cluster), time.perf_counter())

        concurrency = n * args.streams_per_worker
        console.print(f"  up in {startup_s:.1f} s; {concurrency} streams for {args.warmup_s:.0f} + "
                      f"{args.duration_s:.0f} s ...")
        load_before = os.getloadavg()[0]
        traces, w_start, w_end, errors = asyncio.run(_closed_loop(
            cluster.gateway_grpc, concurrency, args.prompt_len, args.max_tokens, args.warmup_s, args.duration_s,
            on_window))
        rss_after = [_rss_mb(pid) for pid in worker_pids]
        dead = [c.name for c in cluster.dead_children()]
    finally:
        cluster.stop()

    (m0, cpu0, t_start), (m1, cpu1, t_end) = snaps["start"], snaps["end"]
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in set(m0) | set(m1)}
    elapsed = t_end - t_start
    model_s = d["model_seconds_total"] or float("nan")
    model_itl = d["decode_model_seconds_total"] / d["decode_tokens_total"] if d["decode_tokens_total"] else float("nan")
    window = [t for t in traces if t.first >= w_start and t.last <= w_end and t.tokens > 1]
    measured_itl = (sum(t.last - t.first for t in window) / sum(t.tokens - 1 for t in window)
                    if window else float("nan"))
    gaps = sorted(g for t in window for g in t.gaps)
    tokens_in_window = sum(t.tokens for t in window)
    cores = {k: (cpu1[k] - cpu0[k]) / elapsed for k in cpu0}
    ours = sum(v for k, v in cores.items() if k != "machine")
    row = {
        "workers": n,
        "streams": concurrency,
        "startup_s": round(startup_s, 2),
        "worker_rss_mb_mean": round(statistics.mean(rss), 1),
        "worker_rss_mb_max_after": round(max(rss_after), 1),
        "window_s": round(elapsed, 2),
        "requests_in_window": len(window),
        "errors": errors,
        "dead_children": dead,
        "tokens_per_s": round(tokens_in_window / elapsed, 1),
        "steps_per_s": round(d["steps_total"] / elapsed, 1),
        "model_step_ms_mean": round(1e3 * model_s / d["steps_total"], 3) if d["steps_total"] else None,
        "overhead_frac": round(d["overhead_seconds_total"] / model_s, 4),
        "overhead_step_p50_ms": round(1e3 * _bucket_quantile(d, "step_overhead_seconds", 0.5), 3),
        "overhead_step_p99_ms": round(1e3 * _bucket_quantile(d, "step_overhead_seconds", 0.99), 3),
        "overhead_cpu_frac": round(d["overhead_cpu_seconds_total"] / model_s, 4),
        "late_frac": round(d["late_seconds_total"] / model_s, 4),
        "lost_frac": round(d["lost_seconds_total"] / model_s, 4),
        "late_step_p99_ms": round(1e3 * _bucket_quantile(d, "step_late_seconds", 0.99), 3),
        "overrun_steps": int(d["overrun_steps_total"]),
        "model_itl_ms": round(1e3 * model_itl, 3),
        "measured_itl_ms": round(1e3 * measured_itl, 3),
        "itl_inflation": round(measured_itl / model_itl - 1, 4),
        "chunk_gap_p50_ms": round(1e3 * gaps[len(gaps) // 2], 3) if gaps else None,
        "chunk_gap_p99_ms": round(1e3 * gaps[int(len(gaps) * 0.99)], 3) if gaps else None,
        "model_decode_ms_at_batch": round(1e3 * perf.decode_time(args.streams_per_worker,
                                                                  args.prompt_len + args.max_tokens / 2), 3),
        "cores": {k: round(v, 2) for k, v in cores.items() if k != "machine"},
        "background_cores": round(max(0.0, cores["machine"] - ours), 2),
        "loadavg_before": round(load_before, 2),
    }
    row["sustained"] = (not dead and errors == 0 and row["overhead_frac"] < args.threshold
                        and row["itl_inflation"] < args.threshold)
    return row


def _table(rows: list[dict], threshold: float) -> Table:
    table = Table(title=f"emulated cluster: control-plane overhead vs the emulated step time (threshold "
                        f"{threshold:.0%})")
    for col in ("N", "streams", "start s", "RSS MB", "tok/s", "step ms", "ovh %", "ovh cpu %",
                "ovh p99 ms", "lost %", "ITL model", "ITL meas", "ITL infl %", "cores w/gw/co/cl",
                "bg cores", "ok"):
        table.add_column(col, justify="right")
    for r in rows:
        c = r["cores"]
        table.add_row(
            str(r["workers"]), str(r["streams"]), f"{r['startup_s']:.1f}", f"{r['worker_rss_mb_mean']:.0f}",
            f"{r['tokens_per_s']:.0f}", f"{r['model_step_ms_mean']:.2f}", f"{100 * r['overhead_frac']:.2f}",
            f"{100 * r['overhead_cpu_frac']:.2f}", f"{r['overhead_step_p99_ms']}", f"{100 * r['lost_frac']:.2f}",
            f"{r['model_itl_ms']:.2f}",
            f"{r['measured_itl_ms']:.2f}", f"{100 * r['itl_inflation']:+.1f}",
            f"{c['workers']:.2f}/{c['gateway']:.2f}/{c['coordinator']:.2f}/{c['client']:.2f}",
            f"{r['background_cores']:.2f}", "yes" if r["sustained"] else "no")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,8,16,32", help="worker counts to sweep")
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model-preset", default="llama-3-8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--policy", default="least_loaded")
    ap.add_argument("--streams-per-worker", type=int, default=1,
                    help="concurrent streaming requests per worker (1: every emulated GPU always decoding)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per worker count; the least disturbed is reported")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--threshold", type=float, default=0.05)
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/splitserve-emulated-bench"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "emulated_cluster.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_dir = REPO / "models" / "demo-llama"  # the gateway's tokenizer; workers read its config.json
    if not (model_dir / "config.json").is_file():  # building it needs torch: only when missing
        from splitserve.cli.models import ensure_demo_model

        model_dir = ensure_demo_model(model_dir)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rows, runs = [], []
    for n in (int(x) for x in args.workers.split(",")):
        attempts = [run_one(args, n, model_dir) for _ in range(args.repeats)]
        runs += attempts
        rows.append(min(attempts, key=lambda r: r["background_cores"]))
        console.print(_table(rows, args.threshold))
    sustained = [r["workers"] for r in rows if r["sustained"]]
    result = {
        "benchmark": "emulated_cluster",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "perf_model": preset(args.gpu, args.model_preset, args.tp).label,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "max_sustained_workers": max(sustained) if sustained else 0,
        "rows": rows,
        "all_runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"largest sustained worker count: [bold]{result['max_sustained_workers']}[/bold] "
                  f"(overhead and ITL inflation < {args.threshold:.0%}); wrote {args.out}")


if __name__ == "__main__":
    main()
