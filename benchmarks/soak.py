"""Bounded soak: minutes of mixed traffic on an emulated cluster, with every service's memory and
file-descriptor growth reported (issue 18; goal: <= 10% from after the warm-up to the end).

The cluster: `start_cluster` with the real control plane (gateway, coordinator, global
scheduler) and `--workers` emulated workers (`--backend emulated`: the real worker service and
serving core, forward passes timed by the performance model), on a private Redis started for
the run (so Redis is measured too; `--redis-url` uses an existing one, then unmeasured).

The traffic: open-loop Poisson arrivals (`--rate`) sent by the load generator's runner
(`loadgen.runner.run_benchmark`) through one target that mixes, by seeded draw:

* gRPC streams, short prompts (32-256 tokens) and long ones (1-3k tokens);
* OpenAI HTTP completions, streamed and not streamed;
* cancellations: a gRPC stream dropped after a few tokens, an HTTP stream closed early;
* sessions: 2-3 rounds over the gRPC session API, each carrying the growing history.

Every `--sample-s` seconds it samples each service process's RSS (psutil, else
/proc/<pid>/status VmRSS), open file descriptors (/proc/<pid>/fd) and threads. Growth per
service = the mean of the last 3 samples over the mean of the first 3 samples after the
warm-up. A service that died, a failed request (other than the intended cancellations) or
growth over `--max-growth` makes the run fail (exit code 1).

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadgen.arrivals import PoissonArrivals  # noqa: E402
from loadgen.plan import BenchRequest, StreamedResult  # noqa: E402
from loadgen.runner import RunProgress, run_benchmark  # noqa: E402
from loadgen.targets import vocab_size_of_model  # noqa: E402
from splitserve.cli.launcher import Cluster, ClusterSpec, start_cluster  # noqa: E402
from splitserve.redis_server import PrivateRedis, free_port, start_private_redis  # noqa: E402

console = Console(stderr=True, width=200)

# Traffic mix: kind -> weight.
MIX = {"grpc_short": 0.30, "grpc_long": 0.12, "http_stream": 0.15, "http_full": 0.15, "grpc_cancel": 0.08,
       "http_cancel": 0.05, "session": 0.15}
CANCEL_KINDS = ("grpc_cancel", "http_cancel")


# ---- process sampling -----------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (psutil when installed, else /proc/<pid>/status VmRSS)."""
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        m = re.search(r"VmRSS:\s+(\d+)\s+kB", Path(f"/proc/{pid}/status").read_text())
        return int(m.group(1)) * 1024 if m else 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    m = re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) if m else 0


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    fds: int
    threads: int


@dataclass
class ServiceSeries:
    name: str
    pid: int
    samples: list[Sample] = field(default_factory=list)
    died_at_s: float | None = None


class Sampler(threading.Thread):
    """Samples every service process every `interval_s` until stopped."""

    def __init__(self, processes: dict[str, int], interval_s: float, t0: float):
        super().__init__(daemon=True, name="soak-sampler")
        self.series = {name: ServiceSeries(name, pid) for name, pid in processes.items()}
        self.interval_s = interval_s
        self.t0 = t0
        self.stopped = threading.Event()

    def sample_once(self) -> None:
        now = time.perf_counter() - self.t0
        for s in self.series.values():
            if s.died_at_s is not None:
                continue
            try:
                s.samples.append(Sample(round(now, 2), round(rss_bytes(s.pid) / 2**20, 2), open_fds(s.pid),
                                        threads(s.pid)))
            except (OSError, ProcessLookupError) as err:
                s.died_at_s = round(now, 2)
                console.print(f"[red]{s.name} (pid {s.pid}) is gone at {now:.0f} s: {err}[/red]")
            except Exception as err:  # psutil.NoSuchProcess and friends
                s.died_at_s = round(now, 2)
                console.print(f"[red]{s.name} (pid {s.pid}) is gone at {now:.0f} s: {err!r}[/red]")

    def run(self) -> None:
        while not self.stopped.is_set():
            self.sample_once()
            self.stopped.wait(self.interval_s)  # the sampling period; stop() ends it at once

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)


# ---- the mixed-traffic target ---------------------------------------------------------------

@dataclass(frozen=True)
class SoakItem:
    kind: str
    prompt: list[int]
    max_tokens: int
    cancel_after: int = 0  # tokens (gRPC) or chunks (HTTP) before the client drops the stream
    rounds: tuple[tuple[list[int], int], ...] = ()  # session: (new tokens, max_tokens) per round


class MixedTarget:
    """A loadgen target whose request id names a planned `SoakItem`: gRPC and HTTP, streamed and not,
    cancelled early, or multi-round sessions."""

    def __init__(self, grpc_address: str, http_base: str, items: dict[str, SoakItem]):
        self.grpc_address = grpc_address
        self.http_base = http_base
        self.items = items
        self.origin_s = time.perf_counter()
        self.model: str | None = None
        self.outcomes: dict[str, dict[str, int]] = {k: {"ok": 0, "error": 0, "cancelled": 0} for k in MIX}
        self.errors: list[str] = []
        self._sdk = None
        self._http: httpx.AsyncClient | None = None

    def now(self) -> float:
        return time.perf_counter() - self.origin_s

    async def open(self) -> None:
        from splitserve.client import AsyncClient

        self._sdk = AsyncClient(self.grpc_address, timeout_s=300, max_retries=0)
        self._http = httpx.AsyncClient(base_url=self.http_base, timeout=httpx.Timeout(300, connect=10),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.model = (await self._http.get("/v1/models")).json()["data"][0]["id"]

    async def close(self) -> None:
        if self._sdk is not None:
            await self._sdk.close()
        if self._http is not None:
            await self._http.aclose()

    async def send(self, request: BenchRequest) -> StreamedResult:
        item = self.items[request.request_id]
        arrival = self.now()
        tokens = 0
        error = None
        outcome = "ok"
        stage = "before the reply"  # where an error happened: before the reply, or after N tokens/chunks
        try:
            if item.kind in ("grpc_short", "grpc_long", "grpc_cancel"):
                async for chunk in self._sdk.stream(item.prompt, max_tokens=item.max_tokens, temperature=0.8,
                                                    seed=len(item.prompt), ignore_eos=True,
                                                    request_id=request.request_id):
                    tokens += len(chunk.token_ids)
                    stage = f"after {tokens} tokens"
                    if item.cancel_after and tokens >= item.cancel_after:
                        outcome = "cancelled"
                        break  # closing the iterator cancels the call
                if outcome == "ok" and tokens != item.max_tokens:
                    raise RuntimeError(f"{tokens} tokens, expected {item.max_tokens}")
            elif item.kind in ("http_stream", "http_cancel"):
                body = {"model": self.model, "prompt": item.prompt, "max_tokens": item.max_tokens,
                        "temperature": 0.0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                chunks = 0
                async with self._http.stream("POST", "/v1/completions", json=body) as reply:
                    if reply.status_code != 200:
                        raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
                    stage = "after the 200, before any chunk"
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        chunks += 1
                        stage = f"after {chunks} chunks"
                        if item.cancel_after and chunks >= item.cancel_after:
                            outcome = "cancelled"
                            break  # leaving the block closes the connection
                if outcome == "ok" and tokens != item.max_tokens:
                    raise RuntimeError(f"usage says {tokens} tokens, expected {item.max_tokens}")
            elif item.kind == "http_full":
                body = {"model": self.model, "prompt": item.prompt, "max_tokens": item.max_tokens,
                        "temperature": 0.0, "ignore_eos": True}
                reply = await self._http.post("/v1/completions", json=body)
                if reply.status_code != 200:
                    raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
                tokens = reply.json()["usage"]["completion_tokens"]
                if tokens != item.max_tokens:
                    raise RuntimeError(f"usage says {tokens} tokens, expected {item.max_tokens}")
            elif item.kind == "session":
                session = await self._sdk.open_session(f"soak-{request.request_id}", ttl_s=120)
                try:
                    for new_tokens, max_tokens in item.rounds:
                        result = await session.generate(new_tokens, max_tokens=max_tokens, temperature=0.0,
                                                        ignore_eos=True)
                        if len(result.token_ids) != max_tokens:
                            raise RuntimeError(f"round: {len(result.token_ids)} tokens, expected {max_tokens}")
                        tokens += len(result.token_ids)
                finally:
                    await session.close()
            else:
                raise ValueError(f"unknown kind {item.kind!r}")
        except (Exception, asyncio.CancelledError) as err:  # noqa: BLE001 -- recorded, never raised
            outcome = "error"
            error = (f"{item.kind} {request.request_id} at {arrival:.1f} s, {stage}: {type(err).__name__}: "
                     f"{str(err)[:300]}")
            if len(self.errors) < 50:
                self.errors.append(error)
        self.outcomes[item.kind][outcome] += 1
        end = self.now()
        return StreamedResult(request.request_id, None, 0, arrival, None, [], end, len(item.prompt), tokens,
                              outcome != "error", error)


def plan_items(n: int, rng: np.random.Generator, vocab: int) -> tuple[list[BenchRequest], dict[str, SoakItem]]:
    kinds = list(MIX)
    weights = np.array([MIX[k] for k in kinds])
    picks = rng.choice(len(kinds), size=n, p=weights / weights.sum())
    requests, items = [], {}

    def ids(lo: int, hi: int) -> list[int]:
        return rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1))).tolist()

    for i, pick in enumerate(picks):
        kind = kinds[int(pick)]
        request_id = f"soak-{uuid.uuid4().hex[:6]}-{i}"
        if kind == "grpc_long":
            item = SoakItem(kind, ids(1024, 3072), int(rng.integers(32, 257)))
        elif kind == "session":
            rounds = tuple((ids(32, 256), int(rng.integers(16, 97))) for _ in range(int(rng.integers(2, 4))))
            item = SoakItem(kind, [], 0, rounds=rounds)
        elif kind in CANCEL_KINDS:
            item = SoakItem(kind, ids(32, 512), 256, cancel_after=int(rng.integers(1, 24)))
        else:
            item = SoakItem(kind, ids(32, 256), int(rng.integers(16, 129)))
        items[request_id] = item
        requests.append(BenchRequest(request_id, item.prompt, item.max_tokens))
    return requests, items


# ---- analysis ----------------------------------------------------------------------------------

def growth(series: ServiceSeries, warmup_s: float, window: int = 3) -> dict:
    after = [s for s in series.samples if s.t_s >= warmup_s]
    if len(after) < 2 * window:
        return {"service": series.name, "pid": series.pid, "samples": len(after), "error": "too few samples"}
    first, last = after[:window], after[-window:]

    def mean(values):
        return statistics.fmean(values)

    rss0, rss1 = mean([s.rss_mb for s in first]), mean([s.rss_mb for s in last])
    fd0, fd1 = mean([s.fds for s in first]), mean([s.fds for s in last])
    th0, th1 = mean([s.threads for s in first]), mean([s.threads for s in last])
    return {
        "service": series.name, "pid": series.pid, "samples": len(after),
        "from_s": first[0].t_s, "to_s": last[-1].t_s,
        "rss_mb_start": round(rss0, 1), "rss_mb_end": round(rss1, 1), "rss_mb_max": max(s.rss_mb for s in after),
        "rss_growth": round(rss1 / rss0 - 1, 4) if rss0 else None,
        "fds_start": round(fd0, 1), "fds_end": round(fd1, 1), "fds_max": max(s.fds for s in after),
        "fds_growth": round(fd1 / fd0 - 1, 4) if fd0 else None,
        "threads_start": round(th0, 1), "threads_end": round(th1, 1),
        "died_at_s": series.died_at_s,
    }


def table(rows: list[dict], max_growth: float) -> Table:
    t = Table(title=f"soak: growth per service from after the warm-up to the end (goal <= {max_growth:.0%})")
    for col in ("service", "pid", "samples", "RSS MB start", "RSS MB end", "RSS max", "RSS growth", "fds start",
                "fds end", "fds growth", "threads", "ok"):
        t.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(r["service"], str(r["pid"]), str(r["samples"]), *["-"] * 8, r["error"])
            continue
        t.add_row(r["service"], str(r["pid"]), str(r["samples"]), f"{r['rss_mb_start']:.1f}",
                  f"{r['rss_mb_end']:.1f}", f"{r['rss_mb_max']:.1f}", f"{100 * r['rss_growth']:+.1f}%",
                  f"{r['fds_start']:.0f}", f"{r['fds_end']:.0f}", f"{100 * r['fds_growth']:+.1f}%",
                  f"{r['threads_start']:.0f}->{r['threads_end']:.0f}", "yes" if r["ok"] else "NO")
    return t


def plot(series: dict[str, ServiceSeries], warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_fd) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for s in series.values():
        t = [x.t_s / 60 for x in s.samples]
        ax_rss.plot(t, [x.rss_mb for x in s.samples], label=s.name)
        ax_fd.plot(t, [x.fds for x in s.samples], label=s.name)
    for ax in (ax_rss, ax_fd):
        ax.axvline(warmup_s / 60, color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    ax_rss.set_ylabel("RSS (MB)")
    ax_fd.set_ylabel("open file descriptors")
    ax_fd.set_xlabel("minutes (dashed: end of warm-up)")
    ax_rss.legend(fontsize=8, ncol=3)
    ax_rss.set_title("soak: every service's memory and file descriptors under mixed traffic")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="traffic duration")
    ap.add_argument("--warmup-minutes", type=float, default=1.0, help="growth is measured from after this")
    ap.add_argument("--sample-s", type=float, default=5.0, help="sampling period")
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=128, help="requests in flight at most")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model-preset", default="llama-3-8b")
    ap.add_argument("--policy", default="least_loaded")
    ap.add_argument("--max-growth", type=float, default=0.10, help="goal: RSS and fd growth per service")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-record-ttl-s", type=float, default=600.0,
                    help="the coordinator's request_record_ttl_s: Redis grows by one record per request for this "
                    "long, then stays flat; shorter than the run minus the warm-up to see the steady state")
    ap.add_argument("--redis-url", default=None, help="an existing Redis (default: a private one, measured too)")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/splitserve-soak"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "soak.json")
    ap.add_argument("--plot", type=Path, default=REPO / "bench-results" / "soak.png")
    args = ap.parse_args()
    if not args.minutes > args.warmup_minutes >= 0:
        ap.error("--minutes must be greater than --warmup-minutes")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_dir = REPO / "models" / "demo-llama"  # the gateway's tokenizer; emulated workers read its config
    if not (model_dir / "config.json").is_file():
        from splitserve.cli.models import ensure_demo_model

        model_dir = ensure_demo_model(model_dir)
    vocab = vocab_size_of_model(str(model_dir)) or 256

    private: PrivateRedis | None = None
    redis_url = args.redis_url
    if redis_url is None:
        private = start_private_redis()
        redis_url = private.url
    args.log_dir.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(
        model=str(model_dir), workers=args.workers, policy=args.policy, http_port=free_port(),
        grpc_port=free_port(), redis_url=redis_url, redis_prefix=f"ss:soak-{uuid.uuid4().hex[:8]}:",
        log_dir=args.log_dir,
        worker_args={"backend": "emulated", "gpu": args.gpu, "model_preset": args.model_preset, "max_num_seqs": 64},
        gateway_args={"max_model_len": 8192, "max_tokens_limit": 4096},
        coordinator_args={"request_record_ttl_s": args.request_record_ttl_s},
    )
    duration_s, warmup_s = args.minutes * 60, args.warmup_minutes * 60
    rng = np.random.default_rng(args.seed)
    n = int(args.rate * duration_s)
    requests, items = plan_items(n, rng, vocab)
    offsets = PoissonArrivals(args.rate).offsets(n, rng)
    keep = offsets < duration_s
    requests, offsets = [r for r, k in zip(requests, keep) if k], offsets[keep]

    console.print(f"starting {args.workers} emulated {args.gpu}/{args.model_preset} workers ...")
    cluster: Cluster = start_cluster(spec, ready_timeout_s=600)
    try:
        processes = {c.name: c.process.pid for c in cluster.children}
        if private is not None:
            processes["redis"] = private.process.pid
        t0 = time.perf_counter()
        sampler = Sampler(processes, args.sample_s, t0)
        sampler.start()
        target = MixedTarget(cluster.gateway_grpc, cluster.gateway_http, items)
        last_print = [0.0]

        def progress(state: RunProgress) -> None:
            if state.elapsed_s - last_print[0] >= 60:
                last_print[0] = state.elapsed_s
                console.print(f"  {state.elapsed_s / 60:4.1f} min: {state.done}/{state.total} done, "
                              f"{state.in_flight} in flight, {state.errors} not ok")

        async def drive():
            await target.open()
            try:
                return await run_benchmark(target, requests, arrival=offsets, max_concurrency=args.max_concurrency,
                                           duration_limit_s=duration_s + 120, progress=progress)
            finally:
                await target.close()

        console.print(f"{len(requests)} requests over {args.minutes:g} min (Poisson {args.rate:g}/s), sampling every "
                      f"{args.sample_s:g} s; warm-up {args.warmup_minutes:g} min")
        results = asyncio.run(drive())
        sampler.sample_once()
        sampler.stop()
        traffic_s = time.perf_counter() - t0
        dead = [c.name for c in cluster.dead_children()]
    finally:
        cluster.stop()
        if private is not None:
            private.stop()

    rows = [growth(s, warmup_s) for s in sampler.series.values()]
    for r in rows:
        r["ok"] = "error" not in r and r["died_at_s"] is None and r["rss_growth"] <= args.max_growth \
            and r["fds_growth"] <= args.max_growth
    errors = sum(v["error"] for v in target.outcomes.values())
    result = {
        "benchmark": "soak",
        "command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_end": os.getloadavg()},
        "traffic_s": round(traffic_s, 1),
        "requests": len(results),
        "by_kind": target.outcomes,
        "errors": errors,
        "error_samples": target.errors,
        "output_tokens": sum(r.output_len for r in results),
        "dead_services": dead,
        "growth": rows,
        "series": {name: [vars(x) for x in s.samples] for name, s in sampler.series.items()},
        "ok": all(r["ok"] for r in rows) and not dead and errors == 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(sampler.series, warmup_s, args.plot)
    console.print(table(rows, args.max_growth))
    kinds = Table(title=f"soak traffic: {len(results)} requests in {traffic_s / 60:.1f} min")
    for col in ("kind", "ok", "cancelled (intended)", "errors"):
        kinds.add_column(col, justify="right")
    for kind, counts in target.outcomes.items():
        kinds.add_row(kind, str(counts["ok"]), str(counts["cancelled"]), str(counts["error"]))
    console.print(kinds)
    for line in target.errors[:10]:
        console.print(f"[red]{line}[/red]")
    console.print(f"{'OK' if result['ok'] else 'FAILED'}; wrote {args.out} and {args.plot}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
