"""Control-plane overhead: one engine in-process vs the same requests through the whole cluster.

Same worker config, same model, same requests, one run:

* latency: requests sent one at a time (no queueing) to
    - ``direct``      an in-process ``Engine`` built from the worker's own config
                      (``workers.server.engine_config_from``): TTFT = add_request → first token
                      event, ITL = gaps between token events;
    - ``gateway``     a 1-worker cluster (``start_cluster``) through the SDK ``Client.stream``
                      (echo token ids): TTFT = send → first chunk with tokens, ITL = chunk gaps;
  and, to split the added latency by hop, the same kind of requests sent straight to
    - ``coordinator`` ``Coordinator.Submit`` (skips the gateway), and
    - ``worker``      ``Worker.Execute`` with a one-stage plan (skips gateway, coordinator,
                      scheduler and Redis).
  The gateway path gets exactly the direct path's requests; the coordinator and worker paths
  get other random prompts of the same lengths, because the worker's prefix cache would
  otherwise serve the repeated prompts from cache.
* throughput: requests/s the gateway sustains for ``max_tokens=1`` with short prompts and
  many concurrent asyncio clients (AsyncClient), with 1 and 2 workers; per-process CPU
  seconds of every service (and of this load generator) over the run show which one saturates.
* ``--profile``: py-spy (``pip install py-spy``) samples every service during a throughput
  run and during a sequential streaming run; self time is grouped by function and by library.

The paths are interleaved request by request. The machine has 2 cores and other processes
may run: CPU used by other processes is measured per repeat (/proc/stat minus ours), repeats
continue up to ``--max-repeats`` until ``--repeats`` quiet ones were seen, and every figure is a
median over repeats (quiet ones when there are >= 3; per-repeat values are in the JSON). With
torch's default 2 intra-op threads the direct engine on the main thread collapses when another
job takes a core, so on a shared machine use ``--num-threads 1`` (the same for the worker and
the direct engine); ``--only-thread-check`` steps the engine on the main thread, a plain thread
and the worker's EngineLoop to show that effect. See docs/control_plane_profile.md.

    .venv/bin/python benchmarks/control_plane.py --out bench-results/control_plane.json
    .venv/bin/python benchmarks/control_plane.py --num-threads 1 --repeats 5 --max-repeats 6 --requests 24 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import grpc  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from common import REPO, percentile_linear  # noqa: E402

from splitserve.cli.models import ensure_demo_model  # noqa: E402
from splitserve.client import AsyncClient, Client, SplitserveClientError  # noqa: E402
from splitserve.config import WorkerConfig  # noqa: E402
from splitserve.cli.launcher import Cluster, ClusterSpec, start_cluster  # noqa: E402
from splitserve.proto import (  # noqa: E402
    coordinator_pb2,
    coordinator_pb2_grpc,
    scheduler_pb2_grpc,
    types_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from splitserve.redis_server import free_port  # noqa: E402
from workers.engine import Engine, SamplingParams, StageSpec  # noqa: E402
from workers.server import engine_config_from  # noqa: E402

console = Console()

TARGETS = {"added_ttft_p99_ms": 5.0, "added_itl_p99_ms": 0.5, "gateway_rps": 500.0}
PERCENTILES = (50, 90, 99)
# A repeat during which other processes used less CPU than this counts as quiet.
QUIET_FOREIGN_CORES = 0.25
# Byte tokens only (the demo vocab is 256 bytes + BOS/EOS/PAD): no special ids in prompts.
PROMPT_VOCAB = 256


# ---------------------------------------------------------------------------------------------
# statistics
def summary_ms(values_s: list[float]) -> dict:
    ms = [v * 1e3 for v in values_s]
    out = {f"p{p}": percentile_linear(ms, p) for p in PERCENTILES}
    out.update(mean=statistics.fmean(ms) if ms else float("nan"), n=len(ms), max=max(ms) if ms else float("nan"))
    return out


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------
# requests
def make_requests(n: int, prompt_lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_VOCAB) for _ in range(prompt_lens[i % len(prompt_lens)])] for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def sampling_proto(max_tokens: int) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# Each path returns, per request: {"ttft": s, "gaps": [s, ...], "tokens": [...], optional "transit": [s, ...]}
def run_direct(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    out = []
    for prompt in prompts:
        rid = uuid.uuid4().hex
        times, tokens = [], []
        t0 = time.perf_counter()
        engine.add_stage(StageSpec.whole(rid, prompt, greedy(max_tokens)))
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.token_ids:
                    times.append(time.perf_counter())
                    tokens.extend(ev.token_ids)
        out.append(_record(t0, times, tokens))
    return out


def run_gateway(client: Client, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    out = []
    for prompt in prompts:
        times, tokens = [], []
        t0 = time.perf_counter()
        for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            if chunk.token_ids:
                times.append(time.perf_counter())
                tokens.extend(chunk.token_ids)
        out.append(_record(t0, times, tokens))
    return out


def _stream_chunks(call, t0: float) -> dict:
    times, tokens, transit = [], [], []
    for chunk in call:
        if chunk.token_ids:
            now = time.perf_counter()
            wall = time.time_ns()
            times.append(now)
            tokens.extend(chunk.token_ids)
            if chunk.emitted_unix_ns:
                transit.append((wall - chunk.emitted_unix_ns) / 1e9)
    rec = _record(t0, times, tokens)
    rec["transit"] = transit
    return rec


def run_coordinator(stub, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    out = []
    for prompt in prompts:
        req = coordinator_pb2.SubmitRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                            sampling=sampling_proto(max_tokens))
        t0 = time.perf_counter()
        out.append(_stream_chunks(stub.Submit(req, timeout=60), t0))
    return out


def run_worker(stub, worker_id: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    out = []
    for prompt in prompts:
        stage = types_pb2.Stage(request_id=uuid.uuid4().hex, worker_id=worker_id, start=0,
                                end=len(prompt) + max_tokens, prompt_token_ids=prompt,
                                sampling=sampling_proto(max_tokens), emit=True)
        t0 = time.perf_counter()
        out.append(_stream_chunks(stub.Execute(stage, timeout=60), t0))
    return out


def _record(t0: float, times: list[float], tokens: list[int]) -> dict:
    return {"ttft": times[0] - t0 if times else float("nan"),
            "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": tokens}


def latency_stats(records: list[dict]) -> dict:
    gaps = [g for r in records for g in r["gaps"]]
    out = {"ttft_ms": summary_ms([r["ttft"] for r in records]), "itl_ms": summary_ms(gaps)}
    transit = [t for r in records for t in r.get("transit", [])]
    if transit:
        out["transit_ms"] = summary_ms(transit)
    return out


def added(base: list[dict], other: list[dict]) -> dict:
    """Added latency of `other` over `base` (same requests, paired by index)."""
    b_ttft = [r["ttft"] for r in base]
    o_ttft = [r["ttft"] for r in other]
    paired = [o - b for o, b in zip(o_ttft, b_ttft)]
    b_gaps = [g for r in base for g in r["gaps"]]
    o_gaps = [g for r in other for g in r["gaps"]]
    # Per token position paired too (same request, same output index) - reported, not the headline.
    paired_gaps = [og - bg for rb, ro in zip(base, other) for bg, og in zip(rb["gaps"], ro["gaps"])]
    out = {}
    for p in PERCENTILES:
        out[f"ttft_paired_p{p}_ms"] = percentile_linear(paired, p) * 1e3
        out[f"ttft_dist_p{p}_ms"] = (percentile_linear(o_ttft, p) - percentile_linear(b_ttft, p)) * 1e3
        out[f"itl_dist_p{p}_ms"] = (percentile_linear(o_gaps, p) - percentile_linear(b_gaps, p)) * 1e3
        out[f"itl_paired_p{p}_ms"] = percentile_linear(paired_gaps, p) * 1e3
    out["ttft_paired_mean_ms"] = statistics.fmean(paired) * 1e3
    out["itl_mean_ms"] = (statistics.fmean(o_gaps) - statistics.fmean(b_gaps)) * 1e3
    return out


def hop_costs(cluster: Cluster, n: int = 300) -> dict:
    """Round trips of the single operations on the request path, measured from this process."""
    import redis

    out = {}
    with grpc.insecure_channel(cluster.worker_addresses[0]) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        out["grpc_unary_worker_GetLoad"] = _timed(lambda: stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5), n)
    with grpc.insecure_channel(cluster.scheduler_address) as ch:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
        out["scheduler_Place"] = _timed(lambda: stub.Place(types_pb2.RequestMeta(
            request_id=uuid.uuid4().hex, prompt_len=16, max_tokens=1), timeout=5), n)
    r = redis.Redis.from_url(cluster.redis_url)
    key = f"{cluster.redis_prefix}bench:hop"

    def put() -> None:  # what StateStore._replace_hash does: MULTI del + hset + pexpire EXEC
        with r.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping={"state": "running", "stages": "[]", "emitted_token_ids": ""})
            pipe.pexpire(key, 60_000)
            pipe.execute()

    out["redis_replace_hash"] = _timed(put, n)
    r.delete(key)
    r.close()
    return out


def _timed(fn, n: int) -> dict:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return summary_ms(times)


# ---------------------------------------------------------------------------------------------
# processes
def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all threads) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (FileNotFoundError, ProcessLookupError):
        return float("nan")


def find_redis_pid(port: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("redis-server") and f":{port}" in cmd:
            return int(entry)
    return None


def process_pids(cluster: Cluster) -> dict[str, int]:
    pids = {c.name: c.process.pid for c in cluster.children}
    pids["loadgen (this process)"] = os.getpid()
    port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    redis_pid = find_redis_pid(port)
    if redis_pid:
        pids["redis"] = redis_pid
    return pids


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine (all cores) from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU cores used by each of our processes over a block, and by every other process (`foreign`)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.m0 = machine_cpu_seconds()
        self.c0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0
        self.cores = {n: (cpu_seconds(p) - self.c0[n]) / self.elapsed for n, p in self.pids.items()}
        machine = (machine_cpu_seconds() - self.m0) / self.elapsed
        self.foreign = max(0.0, machine - sum(v for v in self.cores.values() if v == v))


# ---------------------------------------------------------------------------------------------
# throughput
async def _throughput(target: str, concurrency: int, prompt_len: int, n_requests: int, duration_s: float,
                      seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(PROMPT_VOCAB) for _ in range(prompt_len)] for _ in range(512)]
    latencies: list[float] = []
    errors: collections.Counter = collections.Counter()
    issued = 0
    done_at: list[float] = []
    async with AsyncClient(target, timeout_s=120.0, max_retries=0) as client:
        # warm the channel and every service's paths
        await asyncio.gather(*(client.generate(prompts[i], max_tokens=1, temperature=0.0, ignore_eos=True)
                               for i in range(min(concurrency, 32))))
        start = time.perf_counter()
        stop_at = start + duration_s if duration_s > 0 else float("inf")

        async def one_client() -> None:
            nonlocal issued
            while (n_requests <= 0 or issued < n_requests) and time.perf_counter() < stop_at:
                i = issued
                issued += 1
                t = time.perf_counter()
                try:
                    res = await client.generate(prompts[i % len(prompts)], max_tokens=1, temperature=0.0,
                                                ignore_eos=True)
                    if len(res.token_ids) != 1:
                        errors["wrong_length"] += 1
                        continue
                    now = time.perf_counter()
                    latencies.append(now - t)
                    done_at.append(now)
                except SplitserveClientError as err:
                    errors[err.code.name] += 1

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    # Steady state: completions in the middle 80% of the run (ramp-up and tail excluded).
    done_at.sort()
    steady = float("nan")
    if len(done_at) > 20:
        lo, hi = done_at[len(done_at) // 10], done_at[len(done_at) * 9 // 10]
        steady = (len(done_at) * 8 // 10) / (hi - lo) if hi > lo else float("nan")
    return {"concurrency": concurrency, "completed": len(latencies), "errors": dict(errors), "seconds": elapsed,
            "rps": len(latencies) / elapsed, "steady_rps": steady, "latency_ms": summary_ms(latencies)}


def run_throughput(target: str, concurrency: int, prompt_len: int, n_requests: int, duration_s: float,
                   seed: int, use_uvloop: bool) -> dict:
    coro = _throughput(target, concurrency, prompt_len, n_requests, duration_s, seed)
    if use_uvloop:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# profiling (py-spy)
def _pyspy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def start_pyspy(pids: dict[str, int], duration_s: float, out_dir: Path, tag: str, rate: int) -> list:
    exe = _pyspy()
    if exe is None:
        console.print("[yellow]py-spy not found: pip install py-spy; skipping profiles[/yellow]")
        return []
    procs = []
    for name, pid in pids.items():
        if name == "redis":
            continue
        safe = re.sub(r"[^a-z0-9-]", "", name.split(" ")[0])
        path = out_dir / f"{tag}-{safe}.txt"
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(duration_s)), "--rate", str(rate),
               "--format", "raw", "--threads", "--nonblocking", "--output", str(path)]
        procs.append((name, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    time.sleep(1.0)  # let py-spy attach before the load starts
    return procs


def finish_pyspy(procs: list, rate: int, duration_s: float) -> dict:
    out = {}
    for name, path, proc in procs:
        _, err = proc.communicate(timeout=duration_s + 60)
        if not path.exists():
            out[name] = {"error": err.decode(errors="replace")[-400:]}
            continue
        out[name] = summarize_profile(path, rate, duration_s)
        out[name]["file"] = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    return out


_CATEGORIES = [
    ("torch", ("torch/",)),
    ("engine (workers/engine)", ("workers/engine/",)),
    ("worker service (workers/*.py)", ("workers/",)),
    ("grpc", ("grpc/", "grpc_health", "_cython")),
    ("protobuf", ("google/protobuf", "_pb2")),
    ("redis-py", ("redis/",)),
    ("prometheus_client", ("prometheus_client",)),
    ("opentelemetry", ("opentelemetry",)),
    ("logging", ("logging/",)),
    ("tokenizers/transformers", ("tokenizers", "transformers/")),
    ("gateway", ("gateway/",)),
    ("coordinator", ("services/coordinator",)),
    ("global scheduler", ("services/global_scheduler",)),
    ("splitserve runtime", ("splitserve/",)),
    ("asyncio/uvloop", ("asyncio/", "uvloop")),
    ("loadgen/SDK", ("benchmarks/",)),
]


def _category(frame: str) -> str:
    for name, keys in _CATEGORIES:
        if any(k in frame for k in keys):
            return name
    return "other (stdlib/native)"


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    file = m.group("file")
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{m.group('func')} ({file})"


def summarize_profile(path: Path, rate: int, duration_s: float, top: int = 15) -> dict:
    """Self and inclusive sample counts by function and by library; busy = share of one core."""
    self_counts: collections.Counter = collections.Counter()
    incl_counts: collections.Counter = collections.Counter()
    cat_counts: collections.Counter = collections.Counter()
    thread_counts: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else ""
        frames = [f for f in frames if not f.startswith(("thread ", "process "))]
        if not frames:
            continue
        total += n
        thread_counts[thread] += n
        self_counts[_short(frames[-1])] += n
        # the innermost frame that is not stdlib/native decides the library
        cat_counts[_category(frames[-1])] += n
        for f in set(_short(f) for f in frames):
            incl_counts[f] += n
    expected = rate * duration_s
    return {
        "samples": total,
        "busy_cores": total / expected if expected else float("nan"),
        "threads": {k: v / total for k, v in thread_counts.most_common(6)} if total else {},
        "by_library_self": {k: v / total for k, v in cat_counts.most_common()} if total else {},
        "top_self": [(k, v / total) for k, v in self_counts.most_common(top)] if total else [],
        "top_inclusive": [(k, v / total) for k, v in incl_counts.most_common(top * 3)] if total else [],
    }


# ---------------------------------------------------------------------------------------------
def machine_info() -> dict:
    import torch

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        mem = next(line.split(":", 1)[1].strip() for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "memory": mem,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "grpcio": grpc.__version__,
            "loadavg_start": os.getloadavg()}


def _parse_value(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


SERVICE_ARGS: dict[str, dict] = {}


def wait_ready(target: str, timeout_s: float = 60.0) -> float:
    """Send one request until it succeeds: health SERVING does not mean the scheduler sees a worker yet."""
    started = time.perf_counter()
    with Client(target, timeout_s=10.0, max_retries=0) as client:
        while True:
            try:
                client.generate([1, 2, 3], max_tokens=1, temperature=0.0, ignore_eos=True)
                return time.perf_counter() - started
            except SplitserveClientError:
                if time.perf_counter() - started > timeout_s:
                    raise
                time.sleep(0.1)  # polling readiness, bounded by timeout_s


def start_ready_cluster(spec: ClusterSpec) -> Cluster:
    cluster = start_cluster(spec)
    try:
        waited = wait_ready(cluster.gateway_grpc)
    except BaseException:
        cluster.stop()
        raise
    if waited > 0.05:
        console.print(f"  (first request succeeded {waited:.2f} s after the cluster reported healthy)")
    return cluster


# name -> (coordinator, placement): "process" is the four-service deployment (gateway,
# coordinator, scheduler, workers); "embedded" runs the coordinator in the gateway process
# and places requests inside it (no Coordinator.Submit or GlobalScheduler.Place hop).
TOPOLOGIES = {"process": ("process", "scheduler"), "embedded": ("embedded", "local")}


def cluster_spec(model_dir: Path, workers: int, worker_args: dict, log_dir: Path, redis_url: str,
                 topology: str = "process") -> ClusterSpec:
    coordinator, placement = TOPOLOGIES[topology]
    return ClusterSpec(model=str(model_dir), workers=workers, policy="least_loaded", http_port=free_port(),
                       coordinator=coordinator, placement=placement,
                       grpc_port=free_port(), redis_url=redis_url,
                       redis_prefix=f"ss:bench-cp-{uuid.uuid4().hex[:8]}:", log_dir=log_dir,
                       worker_args=dict(worker_args), scheduler_args=dict(SERVICE_ARGS.get("scheduler", {})),
                       coordinator_args=dict(SERVICE_ARGS.get("coordinator", {})),
                       gateway_args=dict(SERVICE_ARGS.get("gateway", {})))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "demo-llama",
                    help="model directory; built with ensure_demo_model() when missing")
    ap.add_argument("--repeats", type=int, default=5,
                    help="latency repeats wanted during which other processes were quiet")
    ap.add_argument("--max-repeats", type=int, default=12,
                    help="stop adding latency repeats here even if fewer than --repeats were quiet")
    ap.add_argument("--requests", type=int, default=48, help="sequential requests per path per repeat")
    ap.add_argument("--prompt-lens", default="16,32,64,128")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    ap.add_argument("--num-threads", type=int, default=0,
                    help="torch threads of the worker and of the direct engine alike (0: the worker default)")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra WorkerConfig option for the workers (and the direct engine when it is an engine "
                         "option), e.g. kv_transport=grpc; repeatable")
    ap.add_argument("--service-arg", action="append", default=[], metavar="SERVICE:KEY=VALUE",
                    help="extra option of scheduler, coordinator or gateway, e.g. scheduler:view_refresh_s=0.5")
    ap.add_argument("--tput-workers", default="1,2")
    ap.add_argument("--tput-concurrency", default="64,256")
    ap.add_argument("--tput-requests", type=int, default=3000,
                    help="requests per throughput run (0: use --tput-seconds)")
    ap.add_argument("--tput-seconds", type=float, default=0.0, help="time bound of a throughput run (0: none)")
    ap.add_argument("--tput-repeats", type=int, default=3)
    ap.add_argument("--tput-prompt-len", type=int, default=8)
    ap.add_argument("--no-uvloop", action="store_true", help="load generator on asyncio's default loop")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--only-thread-check", action="store_true",
                    help="only step the engine on the main thread, a plain thread and the worker's EngineLoop")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also sample every service with py-spy")
    ap.add_argument("--profile-seconds", type=float, default=20.0)
    ap.add_argument("--profile-rate", type=int, default=200)
    ap.add_argument("--profile-dir", type=Path, default=None,
                    help="where py-spy's raw stacks go (default: a fresh temporary directory)")
    ap.add_argument("--topologies", default="process,embedded",
                    help="comma-separated: process (4 services) | embedded (coordinator + placement in the gateway)")
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "control_plane.json")
    args = ap.parse_args()

    service_args: dict[str, dict] = {"scheduler": {}, "coordinator": {}, "gateway": {}}
    for item in args.service_arg:
        service, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        service_args[service][key] = _parse_value(value)
    SERVICE_ARGS.update(service_args)
    model_dir = args.model_dir if (args.model_dir / "config.json").exists() else ensure_demo_model(args.model_dir)
    worker_args = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    if args.num_threads:
        worker_args["num_threads"] = args.num_threads
    for item in args.worker_arg:
        key, _, value = item.partition("=")
        worker_args[key] = _parse_value(value)
    engine_config = engine_config_from(WorkerConfig(model=str(model_dir), **worker_args))
    prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="control-plane-logs-"))
    results: dict = {
        "command": " ".join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO))
                             else sys.executable] + [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        "machine": machine_info(),
        "config": {"model_dir": str(model_dir), "engine": {k: v for k, v in vars(engine_config).items()},
                   "worker_args": worker_args, "service_args": service_args, "repeats": args.repeats,
                   "max_repeats": args.max_repeats, "requests": args.requests,
                   "prompt_lens": prompt_lens, "max_tokens": args.max_tokens,
                   "tput": {"workers": args.tput_workers, "concurrency": args.tput_concurrency,
                            "requests": args.tput_requests, "seconds": args.tput_seconds,
                            "repeats": args.tput_repeats, "prompt_len": args.tput_prompt_len,
                            "uvloop": not args.no_uvloop}},
        "targets": TARGETS,
        "notes": [
            "2-core machine shared with other processes: figures are medians over repeats.",
            "Latency: the paths interleave request by request (direct, gateway, direct, coordinator, direct, "
            "worker); the cluster is idle (but running) while the direct engine is measured.",
            f"A repeat is 'quiet' when other processes used < {QUIET_FOREIGN_CORES} cores during it (from "
            "/proc/stat minus our processes); the headline is the median over quiet repeats when >= 3, else over all.",
            "Added ITL at p = P_p(cluster gaps) - P_p(direct gaps) over all gaps of a repeat (distribution "
            "difference); itl_paired_* are percentiles of per-(request, token index) differences.",
        ],
    }
    if args.profile:
        args.profile_dir = args.profile_dir or Path(tempfile.mkdtemp(prefix="control-plane-pyspy-"))
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        results["profile_dir"] = str(args.profile_dir)

    if args.only_thread_check:
        engine = Engine(engine_config)
        run_direct(engine, make_requests(8, prompt_lens, seed=10_000), args.max_tokens)  # warm-up
        checks = []
        for _ in range(args.repeats):
            with CpuMeter({"loadgen (this process)": os.getpid()}) as meter:
                check = engine_thread_check(engine, prompt_lens, args.max_tokens)
            check["foreign_cpu_cores"] = meter.foreign
            checks.append(check)
            console.print("ITL p50 main / plain thread / EngineLoop / main: " + " / ".join(
                f"{check[k]['itl_ms']['p50']:.2f}" for k in ("main_thread", "plain_thread", "engine_loop",
                                                             "main_thread_again"))
                + f" ms (other processes {meter.foreign:.2f} cores)")
        results["engine_thread_check"] = checks
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2, default=str))
        return
    results["topologies"] = {}
    for topology in args.topologies.split(","):
        console.print(f"[bold]topology {topology}[/bold]: coordinator {TOPOLOGIES[topology][0]}, "
                      f"placement {TOPOLOGIES[topology][1]}")
        part: dict = {}
        if not args.skip_latency:
            part["latency"] = latency_phase(args, model_dir, engine_config, worker_args, prompt_lens, log_dir,
                                            topology)
        if not args.skip_throughput or args.profile:
            part["throughput"] = throughput_phase(args, model_dir, worker_args, log_dir, topology)
        results["topologies"][topology] = part
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["logs"] = str(log_dir)
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    console.print(f"wrote {args.out} (service logs in {log_dir})")


def engine_thread_check(engine: Engine, prompt_lens: list[int], max_tokens: int, n: int = 24) -> dict:
    """The same engine stepped (a) on this main thread, (b) on a plain threading.Thread, (c) by the worker's
    EngineLoop (engine thread + asyncio queue, no gRPC): isolates what the worker's threading costs per token."""
    import threading

    from workers.engine_loop import EngineLoop

    out: dict = {}
    prompts = make_requests(n, prompt_lens, seed=30_000)
    out["main_thread"] = latency_stats(run_direct(engine, prompts, max_tokens))
    box: list = []
    th = threading.Thread(target=lambda: box.append(run_direct(engine, prompts, max_tokens)))
    th.start()
    th.join()
    out["plain_thread"] = latency_stats(box[0])

    async def through_loop() -> list[dict]:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        recs = []
        try:
            for prompt in prompts:
                times, tokens = [], []
                t0 = time.perf_counter()
                events = await loop.add(StageSpec.whole(uuid.uuid4().hex, prompt, greedy(max_tokens)))
                while True:
                    ev = await events.get()
                    if ev.token_ids:
                        times.append(time.perf_counter())
                        tokens.extend(ev.token_ids)
                    if ev.finished:
                        break
                recs.append(_record(t0, times, tokens))
        finally:
            loop.stop()
        return recs

    try:
        import uvloop

        recs = uvloop.run(through_loop())
    except ImportError:
        recs = asyncio.run(through_loop())
    out["engine_loop"] = latency_stats(recs)
    out["main_thread_again"] = latency_stats(run_direct(engine, prompts, max_tokens))
    return out


def latency_phase(args, model_dir: Path, engine_config, worker_args: dict, prompt_lens: list[int],
                  log_dir: Path, topology: str = "process") -> dict:
    console.print(f"[bold]latency[/bold]: building the direct engine ({engine_config.model})")
    engine = Engine(engine_config)
    run_direct(engine, make_requests(8, prompt_lens, seed=10_000), args.max_tokens)  # warm-up
    with CpuMeter({"loadgen (this process)": os.getpid()}) as meter:
        thread_check = engine_thread_check(engine, prompt_lens, args.max_tokens)
    thread_check["foreign_cpu_cores"] = meter.foreign
    console.print("  engine stepped on the main thread / a plain thread / the worker's EngineLoop (no gRPC): "
                  "ITL p50 " + " / ".join(f"{thread_check[k]['itl_ms']['p50']:.2f}" for k in
                                          ("main_thread", "plain_thread", "engine_loop", "main_thread_again"))
                  + f" ms (other processes {meter.foreign:.2f} cores)")
    cluster = start_ready_cluster(cluster_spec(model_dir, 1, worker_args, log_dir, args.redis_url, topology))
    with_coordinator = cluster.coordinator_address != "embedded"  # else there is no Coordinator service to call
    per_repeat = []
    profile = None
    try:
        worker_id = "worker-0"
        client = Client(cluster.gateway_grpc, timeout_s=120.0, max_retries=0)
        coord_channel = grpc.insecure_channel(cluster.coordinator_address if with_coordinator else "127.0.0.1:1")
        worker_channel = grpc.insecure_channel(cluster.worker_addresses[0])
        coord = coordinator_pb2_grpc.CoordinatorStub(coord_channel)
        worker = worker_pb2_grpc.WorkerStub(worker_channel)
        warm = make_requests(8, prompt_lens, seed=20_000)
        run_gateway(client, warm, args.max_tokens)
        if with_coordinator:
            run_coordinator(coord, warm, args.max_tokens)
        run_worker(worker, worker_id, warm, args.max_tokens)
        pids = process_pids(cluster)
        with CpuMeter(pids) as meter:
            hops = hop_costs(cluster)
        hops["foreign_cpu_cores"] = meter.foreign
        r = -1
        while True:
            r += 1
            n_quiet = sum(rep["foreign_cpu_cores"] < QUIET_FOREIGN_CORES for rep in per_repeat)
            if r >= args.max_repeats or (r >= args.repeats and n_quiet >= args.repeats):
                break
            prompts = make_requests(args.requests, prompt_lens, seed=r)
            others = make_requests(args.requests, prompt_lens, seed=1_000 + r)
            others2 = make_requests(args.requests, prompt_lens, seed=2_000 + r)
            paths = {k: [] for k in ("direct", "gateway", "coordinator", "worker", "direct_o", "direct_o2")}
            with CpuMeter(pids) as meter:
                # Interleaved request by request, so load from other processes hits every path alike.
                for i in range(args.requests):
                    paths["direct"] += run_direct(engine, prompts[i:i + 1], args.max_tokens)
                    paths["gateway"] += run_gateway(client, prompts[i:i + 1], args.max_tokens)
                    if with_coordinator:
                        paths["direct_o"] += run_direct(engine, others[i:i + 1], args.max_tokens)
                        paths["coordinator"] += run_coordinator(coord, others[i:i + 1], args.max_tokens)
                    paths["direct_o2"] += run_direct(engine, others2[i:i + 1], args.max_tokens)
                    paths["worker"] += run_worker(worker, worker_id, others2[i:i + 1], args.max_tokens)
            direct, gw, co, wk = paths["direct"], paths["gateway"], paths["coordinator"], paths["worker"]
            direct_o, direct_o2 = paths["direct_o"], paths["direct_o2"]
            mismatch = sum(a["tokens"] != b["tokens"] for a, b in zip(direct, gw))
            rep = {
                "repeat": r, "token_mismatches_gateway_vs_direct": mismatch,
                "foreign_cpu_cores": meter.foreign, "loadavg": os.getloadavg()[0],
                "direct": latency_stats(direct), "gateway": latency_stats(gw), "worker": latency_stats(wk),
                "direct_worker_prompts": latency_stats(direct_o2),
                "added_gateway": added(direct, gw), "added_worker": added(direct_o2, wk),
            }
            if with_coordinator:
                rep.update(coordinator=latency_stats(co), direct_coordinator_prompts=latency_stats(direct_o),
                           added_coordinator=added(direct_o, co))
            per_repeat.append(rep)
            a = rep["added_gateway"]
            console.print(f"  repeat {r}: added TTFT p50/p99 "
                          f"{a['ttft_paired_p50_ms']:.2f}/{a['ttft_paired_p99_ms']:.2f} ms"
                          f" (paired), added ITL p50/p99 {a['itl_dist_p50_ms']:.3f}/{a['itl_dist_p99_ms']:.3f} ms,"
                          f" mismatched outputs {mismatch}; direct ITL p50 {rep['direct']['itl_ms']['p50']:.2f} ms;"
                          f" other processes' CPU {meter.foreign:.2f} cores")
        if args.profile:
            dur = args.profile_seconds
            procs = start_pyspy(pids, dur, args.profile_dir, "stream", args.profile_rate)
            deadline = time.perf_counter() + dur + 1
            r = 0
            while time.perf_counter() < deadline:
                run_gateway(client, make_requests(4, prompt_lens, seed=50_000 + r), args.max_tokens)
                r += 1
            profile = finish_pyspy(procs, args.profile_rate, dur)
        client.close()
        coord_channel.close()
        worker_channel.close()
    finally:
        cluster.stop()
    out = {"per_repeat": per_repeat, "median": _median_of(per_repeat), "hop_costs_ms": hops,
           "engine_thread_check": thread_check,
           "foreign_cpu_cores_per_repeat": [rep["foreign_cpu_cores"] for rep in per_repeat]}
    quiet = [rep for rep in per_repeat if rep["foreign_cpu_cores"] < QUIET_FOREIGN_CORES]
    out["quiet_repeats"] = [rep["repeat"] for rep in quiet]
    if quiet and len(quiet) < len(per_repeat):
        out["median_quiet"] = _median_of(quiet)
    # The headline: quiet repeats when there are at least 3 of them, else every repeat.
    out["headline"] = "median_quiet" if len(quiet) >= 3 and "median_quiet" in out else "median"
    if profile is not None:
        out["profile_stream"] = profile
    return out


def _cpu_per_request(meter: CpuMeter, res: dict) -> dict:
    """CPU milliseconds each process spent per completed request (whole run incl. warm-up: an upper bound)."""
    done = max(1, res["completed"])
    per = {k: v * meter.elapsed / done * 1e3 for k, v in meter.cores.items()}
    per["total (ours)"] = sum(v for v in per.values() if v == v)
    # Requests/s these processes could sustain on all cores if nothing else ran and CPU were the only limit.
    per["cpu_bound_rps_all_cores"] = (os.cpu_count() or 1) * 1e3 / per["total (ours)"]
    return per


def _median_of(reps: list[dict]) -> dict:
    keys = reps[0]["added_gateway"].keys()
    out = {path: {k: med([rep[path][k] for rep in reps]) for k in keys}
           for path in ("added_gateway", "added_coordinator", "added_worker") if path in reps[0]}
    for path in ("direct", "gateway", "coordinator", "worker"):
        if path not in reps[0]:
            continue
        out[path] = {metric: {k: med([rep[path][metric][k] for rep in reps]) for k in reps[0][path][metric]}
                     for metric in reps[0][path]}
    return out


def throughput_phase(args, model_dir: Path, worker_args: dict, log_dir: Path, topology: str = "process") -> dict:
    out: dict = {"runs": [], "median": {}}
    workers_list = [int(x) for x in args.tput_workers.split(",")] if not args.skip_throughput else [1]
    conc_list = [int(x) for x in args.tput_concurrency.split(",")]
    for n_workers in workers_list:
        console.print(f"[bold]throughput[/bold]: {n_workers} worker(s)")
        cluster = start_ready_cluster(cluster_spec(model_dir, n_workers, worker_args, log_dir, args.redis_url,
                                                   topology))
        try:
            pids = process_pids(cluster)
            if not args.skip_throughput:
                for conc in conc_list:
                    runs = []
                    for r in range(args.tput_repeats):
                        with CpuMeter(pids) as meter:
                            res = run_throughput(cluster.gateway_grpc, conc, args.tput_prompt_len, args.tput_requests,
                                                 args.tput_seconds, seed=r, use_uvloop=not args.no_uvloop)
                        res["cpu_cores"] = meter.cores
                        res["foreign_cpu_cores"] = meter.foreign
                        res["cpu_ms_per_request"] = _cpu_per_request(meter, res)
                        res["workers"] = n_workers
                        res["repeat"] = r
                        runs.append(res)
                        console.print(f"  c={conc} repeat {r}: {res['rps']:.0f} req/s (steady {res['steady_rps']:.0f}),"
                                      f" p50 {res['latency_ms']['p50']:.1f} ms p99 {res['latency_ms']['p99']:.1f} ms,"
                                      f" errors {res['errors']}; other processes {meter.foreign:.2f} cores; CPU cores: "
                                      + ", ".join(f"{k.split(' ')[0]} {v:.2f}" for k, v in meter.cores.items()))
                    out["runs"].extend(runs)
                    out["median"][f"{n_workers}w_c{conc}"] = {
                        "workers": n_workers, "concurrency": conc,
                        "rps": med([x["rps"] for x in runs]), "steady_rps": med([x["steady_rps"] for x in runs]),
                        "latency_p50_ms": med([x["latency_ms"]["p50"] for x in runs]),
                        "latency_p99_ms": med([x["latency_ms"]["p99"] for x in runs]),
                        "errors": sum(sum(x["errors"].values()) for x in runs),
                        "cpu_cores": {k: med([x["cpu_cores"][k] for x in runs]) for k in runs[0]["cpu_cores"]},
                        "foreign_cpu_cores": med([x["foreign_cpu_cores"] for x in runs]),
                        "cpu_ms_per_request": {k: med([x["cpu_ms_per_request"][k] for x in runs])
                                               for k in runs[0]["cpu_ms_per_request"]},
                    }
            if args.profile and n_workers == workers_list[0]:
                conc = max(conc_list)
                dur = args.profile_seconds
                procs = start_pyspy(pids, dur, args.profile_dir, f"tput-c{conc}", args.profile_rate)
                with CpuMeter(pids) as meter:
                    res = run_throughput(cluster.gateway_grpc, conc, args.tput_prompt_len, 0, dur + 2, seed=99,
                                         use_uvloop=not args.no_uvloop)
                res["cpu_cores"] = meter.cores
                res["foreign_cpu_cores"] = meter.foreign
                res["cpu_ms_per_request"] = _cpu_per_request(meter, res)
                out["profile_run"] = res
                out["profile"] = finish_pyspy(procs, args.profile_rate, dur)
                console.print(f"  profiled run c={conc}: {res['rps']:.0f} req/s")
        finally:
            cluster.stop()
    return out


def _report_latency(med_: dict, n: int, label: str) -> None:
    t = Table(title=f"Latency, sequential requests (median of {n} repeats: {label})")
    for col in ("path", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "worker→client p50/p99 ms"):
        t.add_column(col, justify="right")
    for path in ("direct", "worker", "coordinator", "gateway"):
        if path not in med_:
            continue
        s = med_[path]
        transit = s.get("transit_ms")
        t.add_row(path, f"{s['ttft_ms']['p50']:.2f}", f"{s['ttft_ms']['p99']:.2f}", f"{s['itl_ms']['p50']:.3f}",
                  f"{s['itl_ms']['p99']:.3f}",
                  f"{transit['p50']:.3f}/{transit['p99']:.3f}" if transit else "-")
    console.print(t)
    t = Table(title="Added latency over the direct engine (median of repeats)")
    for col in ("path", "TTFT p50 (paired)", "TTFT p99 (paired)", "TTFT p50 (dist)", "TTFT p99 (dist)",
                "ITL p50 (dist)", "ITL p99 (dist)", "ITL mean"):
        t.add_column(col, justify="right")
    for path, key in (("worker gRPC only", "added_worker"), ("coordinator (+sched, Redis)", "added_coordinator"),
                      ("gateway (full path)", "added_gateway")):
        if key not in med_:
            continue
        a = med_[key]
        t.add_row(path, *(f"{a[k]:.3f}" for k in ("ttft_paired_p50_ms", "ttft_paired_p99_ms", "ttft_dist_p50_ms",
                                                   "ttft_dist_p99_ms", "itl_dist_p50_ms", "itl_dist_p99_ms",
                                                   "itl_mean_ms")))
    console.print(t)
    a = med_["added_gateway"]
    ok_ttft = a["ttft_paired_p99_ms"] <= TARGETS["added_ttft_p99_ms"]
    ok_itl = a["itl_dist_p99_ms"] <= TARGETS["added_itl_p99_ms"]
    console.print(f"target added TTFT p99 <= {TARGETS['added_ttft_p99_ms']} ms: "
                  f"{'[green]met' if ok_ttft else '[red]missed'}[/] ({a['ttft_paired_p99_ms']:.2f} ms); "
                  f"added ITL p99 <= {TARGETS['added_itl_p99_ms']} ms: "
                  f"{'[green]met' if ok_itl else '[red]missed'}[/] ({a['itl_dist_p99_ms']:.3f} ms)")


def report(results: dict) -> None:
    m = results["machine"]
    console.print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
                  f"grpcio {m['grpcio']}, load avg {m['loadavg_start'][0]:.2f} → {m['loadavg_end'][0]:.2f}")
    console.print(f"command: {results['command']}")
    for topology, part in results.get("topologies", {}).items():
        console.print(f"[bold]== topology {topology} ==[/bold]")
        _report_topology(part)


def _report_topology(results: dict) -> None:
    lat = results.get("latency")
    if lat:
        console.print("other processes' CPU per latency repeat (cores): "
                      + ", ".join(f"{x:.2f}" for x in lat["foreign_cpu_cores_per_repeat"]))
        hops = lat.get("hop_costs_ms", {})
        if hops:
            console.print("single-operation round trips from the load generator (p50/p99 ms): " + ", ".join(
                f"{k} {v['p50']:.3f}/{v['p99']:.3f}" for k, v in hops.items() if isinstance(v, dict)))
        console.print(f"quiet repeats: {lat['quiet_repeats']} of {len(lat['per_repeat'])}; headline: {lat['headline']}")
        for key in ("median", "median_quiet"):
            if key in lat:
                _report_latency(lat[key], len(lat["per_repeat"]) if key == "median" else len(lat["quiet_repeats"]),
                                "all repeats" if key == "median" else
                                f"quiet repeats only (other processes < {QUIET_FOREIGN_CORES} cores)")
    tp = results.get("throughput")
    if tp and tp["median"]:
        t = Table(title="Gateway throughput, max_tokens=1 (median of repeats)")
        for col in ("workers", "concurrency", "req/s", "steady req/s", "p50 ms", "p99 ms", "errors",
                    "other procs cores", "CPU ms/request by process", "CPU-bound req/s"):
            t.add_column(col, justify="right")
        for v in tp["median"].values():
            per = v["cpu_ms_per_request"]
            cpu = ", ".join(f"{k.split(' ')[0]} {c:.2f}" for k, c in per.items() if k != "cpu_bound_rps_all_cores")
            t.add_row(str(v["workers"]), str(v["concurrency"]), f"{v['rps']:.0f}", f"{v['steady_rps']:.0f}",
                      f"{v['latency_p50_ms']:.1f}", f"{v['latency_p99_ms']:.1f}", str(v["errors"]),
                      f"{v['foreign_cpu_cores']:.2f}", cpu, f"{per['cpu_bound_rps_all_cores']:.0f}")
        console.print(t)
        best = max(v["rps"] for v in tp["median"].values())
        console.print(f"target gateway >= {TARGETS['gateway_rps']:.0f} req/s: "
                      f"{'[green]met' if best >= TARGETS['gateway_rps'] else '[red]missed'}[/] (best {best:.0f} req/s)")
    for key, prof in (("throughput", (tp or {}).get("profile")), ("latency", (lat or {}).get("profile_stream"))):
        if not prof:
            continue
        t = Table(title=f"py-spy ({key} run): busy cores and top self time")
        t.add_column("process")
        t.add_column("busy cores", justify="right")
        t.add_column("self time by library")
        t.add_column("top self frames")
        for name, p in prof.items():
            if "error" in p:
                t.add_row(name, "-", p["error"][:80], "")
                continue
            libs = ", ".join(f"{k} {v:.0%}" for k, v in list(p["by_library_self"].items())[:5])
            frames = "\n".join(f"{v:.0%} {k[:70]}" for k, v in p["top_self"][:4])
            t.add_row(name, f"{p['busy_cores']:.2f}", libs, frames)
        console.print(t)


if __name__ == "__main__":
    main()
