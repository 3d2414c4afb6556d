"""10x overload: measure an emulated cluster's capacity with the gateway's admission limits on,
then offer it ten times that (open-loop Poisson) and check that nothing admitted is dropped
(issue 18).

The cluster: `start_cluster` with the real control plane and `--workers` emulated workers
(`--backend emulated`), the gateway's admission limits set low enough to bind
(`--max-concurrent` requests in flight, `--max-queued` waiting at most `--queue-timeout-s`),
optionally a per-API-key rate limit (`--rate-limit-rpm`, token buckets in Redis).

1. Capacity: a closed loop of exactly `--max-concurrent` clients (what admission lets run at
   once) for `--capacity-s`; capacity = requests completed per second after a warm-up.
2. Overload: Poisson arrivals at `--factor` x capacity for `--overload-s`, sent by the load
   generator's runner, half over the OpenAI HTTP API and half over gRPC, no client retries.
   Every request must end as one of: completed (all `max_tokens` tokens: `ignore_eos`), or
   refused with HTTP 429 + `Retry-After` / RESOURCE_EXHAUSTED + `retry-after-ms`. Anything
   else is counted against the cluster: a 5xx, a refusal without a retry hint, another error,
   or a request that was admitted (HTTP 200 / first token) and then did not complete
   (dropped).
3. Services: every service process must be alive at the end, RSS sampled every second
   (peak and growth reported, bounded by `--max-rss-growth`).

Goodput = completed requests per second during the overload window, against the capacity
(goal: >= `--min-goodput` of it).

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/overload.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from common import REPO, percentile_floor_rank

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadgen.arrivals import PoissonArrivals  # noqa: E402
from loadgen.plan import BenchRequest, StreamedResult  # noqa: E402
from loadgen.runner import run_benchmark  # noqa: E402
from loadgen.targets import vocab_size_of_model  # noqa: E402
from splitserve.cli.launcher import ClusterSpec, start_cluster  # noqa: E402
from splitserve.redis_server import PrivateRedis, free_port, start_private_redis  # noqa: E402

console = Console(stderr=True, width=200)
API_KEY = "overload-bench-key"

COMPLETED, REFUSED, REFUSED_NO_HINT, SERVER_ERROR, DROPPED, OTHER = (
    "completed", "refused_with_retry_after", "refused_without_hint", "5xx", "dropped_after_admission", "other_error")
OUTCOMES = (COMPLETED, REFUSED, REFUSED_NO_HINT, SERVER_ERROR, DROPPED, OTHER)


@dataclass
class Outcome:
    request_id: str
    api: str  # http | grpc
    outcome: str
    sent_s: float
    end_s: float
    tokens: int
    detail: str = ""
    retry_after_s: float | None = None


class OverloadTarget:
    """A loadgen target that classifies each request's end (see the module docstring)."""

    def __init__(self, grpc_address: str, http_base: str, max_tokens: int, api_key: str | None):
        self.grpc_address = grpc_address
        self.http_base = http_base
        self.max_tokens = max_tokens
        self.api_key = api_key
        self.origin_s = time.perf_counter()
        self.outcomes: list[Outcome] = []
        self.model: str | None = None
        self._sdk = None
        self._http: httpx.AsyncClient | None = None

    def now(self) -> float:
        return time.perf_counter() - self.origin_s

    async def open(self) -> None:
        from splitserve.client import AsyncClient

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._sdk = AsyncClient(self.grpc_address, api_key=self.api_key, timeout_s=600, max_retries=0)
        self._http = httpx.AsyncClient(base_url=self.http_base, headers=headers,
                                       timeout=httpx.Timeout(600, connect=10),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.model = (await self._http.get("/v1/models")).json()["data"][0]["id"]

    async def close(self) -> None:
        if self._sdk is not None:
            await self._sdk.close()
        if self._http is not None:
            await self._http.aclose()

    async def send(self, request: BenchRequest) -> StreamedResult:
        api = "http" if int(request.request_id.rsplit("-", 1)[1]) % 2 else "grpc"
        sent = self.now()
        out = await (self._http_one(request) if api == "http" else self._grpc_one(request))
        out.api, out.sent_s, out.end_s = api, round(sent, 3), round(self.now(), 3)
        self.outcomes.append(out)
        return StreamedResult(request.request_id, None, 0, sent, None, [], out.end_s, request.prompt_len, out.tokens,
                              out.outcome == COMPLETED, None if out.outcome == COMPLETED else out.outcome)

    async def _http_one(self, request: BenchRequest) -> Outcome:
        body = {"model": self.model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        admitted, tokens = False, 0
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code == 429:
                    hint = reply.headers.get("retry-after")
                    await reply.aread()
                    return Outcome(request.request_id, "http", REFUSED if hint else REFUSED_NO_HINT, 0, 0, 0,
                                   "429", float(hint) if hint else None)
                if reply.status_code >= 500:
                    text = (await reply.aread()).decode(errors="replace")[:200]
                    return Outcome(request.request_id, "http", SERVER_ERROR, 0, 0, 0,
                                   f"HTTP {reply.status_code}: {text}")
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")[:200]
                    return Outcome(request.request_id, "http", OTHER, 0, 0, 0, f"HTTP {reply.status_code}: {text}")
                admitted = True
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Outcome(request.request_id, "http", DROPPED, 0, 0, tokens,
                                       f"stream error: {str(chunk['error'])[:200]}")
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        except (httpx.HTTPError, ValueError) as err:
            return Outcome(request.request_id, "http", DROPPED if admitted else OTHER, 0, 0, tokens,
                           f"{type(err).__name__}: {err}"[:200])
        if tokens != request.output_len:
            return Outcome(request.request_id, "http", DROPPED, 0, 0, tokens,
                           f"{tokens} of {request.output_len} tokens")
        return Outcome(request.request_id, "http", COMPLETED, 0, 0, tokens)

    async def _grpc_one(self, request: BenchRequest) -> Outcome:
        from splitserve.client import RateLimitedError, SplitserveClientError

        tokens = 0
        try:
            async for chunk in self._sdk.stream(request.prompt_token_ids, max_tokens=request.output_len,
                                                temperature=0.0, ignore_eos=True, request_id=request.request_id):
                tokens += len(chunk.token_ids)
        except RateLimitedError as err:
            if tokens:
                return Outcome(request.request_id, "grpc", DROPPED, 0, 0, tokens, f"{err.code.name}: {err.message}")
            return Outcome(request.request_id, "grpc", REFUSED if err.retry_after_s else REFUSED_NO_HINT, 0, 0, 0,
                           err.message[:200], err.retry_after_s)
        except SplitserveClientError as err:
            kind = DROPPED if tokens else (SERVER_ERROR if err.code.name in ("INTERNAL", "UNKNOWN", "DATA_LOSS")
                                           else OTHER)
            return Outcome(request.request_id, "grpc", kind, 0, 0, tokens, f"{err.code.name}: {err.message}"[:200])
        if tokens != request.output_len:
            return Outcome(request.request_id, "grpc", DROPPED, 0, 0, tokens, f"{tokens} of {request.output_len}")
        return Outcome(request.request_id, "grpc", COMPLETED, 0, 0, tokens)


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], interval_s: float = 1.0):
        super().__init__(daemon=True)
        self.pids = pids
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self.stopped = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        import psutil

        while not self.stopped.is_set():
            now = time.perf_counter() - self.t0
            for name, pid in self.pids.items():
                try:
                    self.samples[name].append((round(now, 2), psutil.Process(pid).memory_info().rss / 2**20))
                except psutil.Error:
                    pass  # a dead process is caught by the liveness check
            self.stopped.wait(self.interval_s)  # the sampling period; set() ends it at once

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


def make_requests(n: int, rng: np.random.Generator, vocab: int, prompt: tuple[int, int], max_tokens: int,
                  tag: str) -> list[BenchRequest]:
    return [BenchRequest(f"{tag}-{uuid.uuid4().hex[:6]}-{i}",
                         rng.integers(0, vocab, size=int(rng.integers(prompt[0], prompt[1] + 1))).tolist(),
                         max_tokens) for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--model-preset", default="llama-3-8b")
    ap.add_argument("--max-concurrent", type=int, default=16, help="gateway max_concurrent_requests")
    ap.add_argument("--max-queued", type=int, default=32, help="gateway max_queued_requests")
    ap.add_argument("--queue-timeout-s", type=float, default=5.0, help="gateway queue_timeout_s")
    ap.add_argument("--rate-limit-rpm", type=int, default=0, help="per-API-key requests per minute (0: off)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--prompt-len", default="128,512", help="MIN,MAX prompt tokens")
    ap.add_argument("--capacity-s", type=float, default=40.0)
    ap.add_argument("--capacity-warmup-s", type=float, default=10.0)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--overload-s", type=float, default=60.0)
    ap.add_argument("--min-goodput", type=float, default=0.8, help="goal: overload goodput / capacity")
    ap.add_argument("--max-rss-growth", type=float, default=0.5, help="bound: a service's peak RSS / its RSS before")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/splitserve-overload"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "overload.json")
    ap.add_argument("--plot", type=Path, default=REPO / "bench-results" / "overload.png")
    args = ap.parse_args()
    prompt = tuple(int(x) for x in args.prompt_len.split(","))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_dir = REPO / "models" / "demo-llama"
    if not (model_dir / "config.json").is_file():
        from splitserve.cli.models import ensure_demo_model

        model_dir = ensure_demo_model(model_dir)
    vocab = vocab_size_of_model(str(model_dir)) or 256
    rng = np.random.default_rng(args.seed)
    gateway_args: dict[str, object] = {"max_model_len": 8192, "max_tokens_limit": 4096,
                                       "max_concurrent_requests": args.max_concurrent,
                                       "max_queued_requests": args.max_queued, "queue_timeout_s": args.queue_timeout_s}
    api_key = None
    if args.rate_limit_rpm:
        api_key = API_KEY
        gateway_args.update(api_keys=API_KEY, rate_limit_requests_per_minute=args.rate_limit_rpm)
    private: PrivateRedis = start_private_redis()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    spec = ClusterSpec(
        model=str(model_dir), workers=args.workers, http_port=free_port(), grpc_port=free_port(),
        redis_url=private.url, redis_prefix=f"ss:overload-{uuid.uuid4().hex[:8]}:", log_dir=args.log_dir,
        worker_args={"backend": "emulated", "gpu": args.gpu, "model_preset": args.model_preset, "max_num_seqs": 64},
        gateway_args=gateway_args)
    console.print(f"starting {args.workers} emulated {args.gpu}/{args.model_preset} workers; admission "
                  f"{args.max_concurrent} in flight + {args.max_queued} queued ({args.queue_timeout_s:g} s)")
    cluster = start_cluster(spec, ready_timeout_s=600)
    try:
        pids = {c.name: c.process.pid for c in cluster.children}
        pids["redis"] = private.process.pid
        sampler = RssSampler(pids)
        sampler.start()

        async def capacity_phase() -> tuple[float, OverloadTarget]:
            target = OverloadTarget(cluster.gateway_grpc, cluster.gateway_http, args.max_tokens, api_key)
            await target.open()
            try:
                n = int(args.max_concurrent * args.capacity_s * 10)
                requests = make_requests(n, rng, vocab, prompt, args.max_tokens, "cap")
                await run_benchmark(target, requests, concurrency=args.max_concurrent,
                                    duration_limit_s=args.capacity_s)
            finally:
                await target.close()
            done = [o for o in target.outcomes if o.outcome == COMPLETED and o.end_s >= args.capacity_warmup_s]
            return len(done) / (args.capacity_s - args.capacity_warmup_s), target

        console.print(f"capacity: closed loop of {args.max_concurrent} for {args.capacity_s:g} s ...")
        rss_before = {name: s[-1][1] for name, s in sampler.samples.items() if s}
        # One event loop for both phases: gRPC's aio poller outlives a loop closed under it.
        loop = asyncio.new_event_loop()
        capacity, cap_target = loop.run_until_complete(capacity_phase())
        cap_bad = Counter(o.outcome for o in cap_target.outcomes if o.outcome != COMPLETED)
        if capacity <= 0:
            raise RuntimeError(f"no request completed in the capacity phase: {dict(cap_bad)}")
        rate = args.factor * capacity
        console.print(f"capacity {capacity:.2f} req/s; offering {rate:.1f} req/s ({args.factor:g}x) for "
                      f"{args.overload_s:g} s ...")

        async def overload_phase() -> OverloadTarget:
            target = OverloadTarget(cluster.gateway_grpc, cluster.gateway_http, args.max_tokens, api_key)
            await target.open()
            try:
                n = int(rate * args.overload_s * 1.2) + 10
                requests = make_requests(n, rng, vocab, prompt, args.max_tokens, "ovl")
                offsets = PoissonArrivals(rate).offsets(n, rng)
                keep = offsets < args.overload_s
                await run_benchmark(target, [r for r, k in zip(requests, keep) if k], arrival=offsets[keep],
                                    duration_limit_s=args.overload_s + 300)
            finally:
                await target.close()
            return target

        t_overload = time.perf_counter() - sampler.t0
        try:
            target = loop.run_until_complete(overload_phase())
        finally:
            loop.close()
        t_end = time.perf_counter() - sampler.t0
        sampler.stop()
        alive = {c.name: c.process.poll() is None for c in cluster.children}
        alive["redis"] = private.process.poll() is None
    finally:
        cluster.stop()
        private.stop()

    outcomes = target.outcomes
    counts = Counter(o.outcome for o in outcomes)
    by_api = {api: Counter(o.outcome for o in outcomes if o.api == api) for api in ("http", "grpc")}
    completed = [o for o in outcomes if o.outcome == COMPLETED]
    # Goodput over the arrival window: completions that ended within it (the system at 10x).
    window = [o for o in completed if o.end_s <= args.overload_s]
    goodput = len(window) / args.overload_s
    goodput_all = len(completed) / max(o.end_s for o in outcomes)
    latencies = sorted(o.end_s - o.sent_s for o in completed)
    refusals = sorted(o.end_s - o.sent_s for o in outcomes if o.outcome == REFUSED)
    hints = sorted(o.retry_after_s for o in outcomes if o.outcome == REFUSED and o.retry_after_s is not None)
    rss = {}
    for name, series in sampler.samples.items():
        values = [v for _, v in series]
        before = rss_before.get(name) or (values[0] if values else 0)
        rss[name] = {"before_mb": round(before, 1), "peak_mb": round(max(values), 1) if values else None,
                     "end_mb": round(values[-1], 1) if values else None,
                     "peak_growth": round(max(values) / before - 1, 3) if values and before else None}
    bad = {k: counts[k] for k in (REFUSED_NO_HINT, SERVER_ERROR, DROPPED, OTHER) if counts[k]}

    def pct(values, q):
        return round(percentile_floor_rank(values, q), 3) if values else None

    checks = {
        "no admitted request dropped": counts[DROPPED] == 0,
        "every refusal has a retry hint": counts[REFUSED_NO_HINT] == 0,
        "no 5xx / internal error": counts[SERVER_ERROR] == 0,
        "no other error": counts[OTHER] == 0,
        "every service alive": all(alive.values()),
        f"RSS peak within +{args.max_rss_growth:.0%}": all(
            r["peak_growth"] is not None and r["peak_growth"] <= args.max_rss_growth for r in rss.values()),
        f"goodput >= {args.min_goodput:.0%} of capacity": goodput >= args.min_goodput * capacity,
    }
    result = {
        "benchmark": "overload",
        "command": " ".join(["benchmarks/overload.py", *sys.argv[1:]]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_end": os.getloadavg()},
        "capacity_rps": round(capacity, 3),
        "capacity_phase_not_completed": dict(cap_bad),
        "offered_rps": round(rate, 3),
        "requests": len(outcomes),
        "outcomes": {k: counts[k] for k in OUTCOMES},
        "by_api": {api: dict(c) for api, c in by_api.items()},
        "goodput_rps": round(goodput, 3),
        "goodput_rps_incl_drain": round(goodput_all, 3),
        "goodput_over_capacity": round(goodput / capacity, 3),
        "completed_latency_s": {"p50": pct(latencies, 50), "p99": pct(latencies, 99)},
        "refusal_latency_s": {"p50": pct(refusals, 50), "p99": pct(refusals, 99)},
        "retry_after_s": {"min": hints[0] if hints else None, "p50": pct(hints, 50),
                          "max": hints[-1] if hints else None},
        "bad_samples": [asdict(o) for o in outcomes if o.outcome in bad][:30],
        "alive": alive,
        "rss": rss,
        "checks": checks,
        "ok": all(checks.values()),
        "timeline": {"overload_start_s": round(t_overload, 2), "end_s": round(t_end, 2)},
        "rss_series": sampler.samples,
        "outcome_times": [(o.sent_s, o.end_s, o.outcome) for o in outcomes],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, args.plot)

    t = Table(title=f"10x overload: capacity {capacity:.2f} req/s, offered {rate:.1f} req/s for {args.overload_s:g} s "
                    f"({len(outcomes)} requests)")
    for col in ("api", *OUTCOMES):
        t.add_column(col, justify="right")
    for api, c in by_api.items():
        t.add_row(api, *(str(c[k]) for k in OUTCOMES))
    t.add_row("all", *(str(counts[k]) for k in OUTCOMES))
    console.print(t)
    s = Table(title="services")
    for col in ("service", "alive", "RSS before MB", "peak MB", "end MB", "peak growth"):
        s.add_column(col, justify="right")
    for name, r in rss.items():
        s.add_row(name, "yes" if alive.get(name) else "NO", str(r["before_mb"]), str(r["peak_mb"]), str(r["end_mb"]),
                  f"{100 * (r['peak_growth'] or 0):+.1f}%")
    console.print(s)
    c = Table(title=f"checks (goodput {goodput:.2f} req/s = {goodput / capacity:.0%} of capacity; completed p50/p99 "
                    f"{result['completed_latency_s']['p50']}/{result['completed_latency_s']['p99']} s; refusals "
                    f"p50/p99 {result['refusal_latency_s']['p50']}/{result['refusal_latency_s']['p99']} s)")
    c.add_column("check")
    c.add_column("ok")
    for name, ok in checks.items():
        c.add_row(name, "yes" if ok else "NO")
    console.print(c)
    for o in result["bad_samples"][:10]:
        console.print(f"[red]{o}[/red]")
    console.print(f"{'OK' if result['ok'] else 'FAILED'}; wrote {args.out} and {args.plot}")
    return 0 if result["ok"] else 1


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_out, ax_rss) = plt.subplots(2, 1, figsize=(10, 7))
    times = result["outcome_times"]
    horizon = max((end for _, end, _ in times), default=1.0)
    bins = np.arange(0, horizon + 2, 2.0)
    for outcome in OUTCOMES:
        ends = [end for _, end, o in times if o == outcome]
        if ends:
            hist, _ = np.histogram(ends, bins=bins)
            ax_out.plot(bins[:-1], hist / 2.0, label=outcome)
    ax_out.axhline(result["capacity_rps"], color="grey", linestyle="--", linewidth=1, label="capacity")
    ax_out.set_ylabel("requests/s ending so")
    ax_out.set_xlabel("seconds into the overload phase")
    ax_out.set_yscale("symlog")
    ax_out.legend(fontsize=8)
    ax_out.set_title(f"10x overload: offered {result['offered_rps']:.1f} req/s, capacity {result['capacity_rps']:.2f}")
    for name, series in result["rss_series"].items():
        if series:
            ax_rss.plot([t for t, _ in series], [v for _, v in series], label=name)
    ax_rss.axvline(result["timeline"]["overload_start_s"], color="grey", linestyle="--", linewidth=1)
    ax_rss.set_ylabel("RSS (MB)")
    ax_rss.set_xlabel("seconds since the cluster started (dashed: overload begins)")
    ax_rss.legend(fontsize=8, ncol=3)
    for ax in (ax_out, ax_rss):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
