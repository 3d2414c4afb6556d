"""The floor under the control-plane targets: what a bare Python gRPC stream hop adds here.

No splitserve code runs in it. A long-lived producer thread does ~`--step-ms` of torch compute per
"token" (one torch thread) and hands each token to an asyncio loop with
`call_soon_threadsafe`, exactly as the worker's EngineLoop does. Three paths, interleaved
request by request so load hits them alike:

- direct: the tokens as the producer's own loop sees them (the in-process engine);
- hop1:   a grpc.aio server (uvloop) streams each token to a sync client in another
          process (the shape of Worker.Execute -> caller);
- hop2:   the same through one grpc.aio relay process in between (worker -> gateway with
          an embedded coordinator -> client: the shortest splitserve path).

Added TTFT (request -> first token) is paired per request; added ITL is the difference of
the gap distributions at the same percentile — the same definitions as
benchmarks/control_plane.py, so its figures can be read against these.

    .venv/bin/python benchmarks/grpc_floor.py --repeats 5 --out bench-results/grpc_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from common import REPO

METHOD = "/floor.Floor/Stream"


def matmuls_per_step(step_ms: float) -> int:
    """How many 256x256 torch matmuls (one thread) take step_ms here; measured once, in the parent."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for _ in range(50):  # warm-up
        a @ a
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(50):
            a @ a
        samples.append((time.perf_counter() - started) / 50)
    return max(1, round(step_ms / 1e3 / statistics.median(samples)))


class Producer:
    """One long-lived compute thread, like the worker's engine thread: requests in, tokens out.

    Long-lived matters: torch's OpenMP team is per thread, so a thread per request would
    pay for a new team (milliseconds) on its first matmul.
    """

    def __init__(self, matmuls: int):
        self.matmuls = matmuls
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def stream(self, loop: asyncio.AbstractEventLoop, num_tokens: int) -> asyncio.Queue:
        """Queue a request; its tokens arrive on the returned queue, on `loop`."""
        tokens: asyncio.Queue = asyncio.Queue()
        self._requests.put((loop, tokens, num_tokens))
        return tokens

    def _run(self) -> None:
        import torch

        torch.set_num_threads(1)  # on this thread: the OpenMP setting is per thread
        a = torch.randn(256, 256)
        while True:
            loop, tokens, num_tokens = self._requests.get()
            for i in range(num_tokens):
                for _ in range(self.matmuls):  # GIL released, like a forward pass
                    a @ a
                loop.call_soon_threadsafe(tokens.put_nowait, i.to_bytes(4, "little"))


def serve(port: int, upstream: str, matmuls: int, num_tokens: int) -> None:
    """A producer (no upstream) or a relay to `upstream`, on uvloop, until killed."""
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if upstream:
            channel = grpc.aio.insecure_channel(upstream)
            call_upstream = channel.unary_stream(METHOD)

            async def handler(request, context):
                async for message in call_upstream(request):
                    yield message
        else:
            producer = Producer(matmuls)

            async def handler(request, context):
                tokens = producer.stream(loop, num_tokens)
                for _ in range(num_tokens):
                    yield await tokens.get()

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "floor.Floor", {"Stream": grpc.unary_stream_rpc_method_handler(handler)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def client_run(call) -> tuple[float, list[float]]:
    started = time.perf_counter()
    times = [time.perf_counter() for _ in call(b"go")]
    return times[0] - started, list(np.diff(times))


def direct_run(loop: asyncio.AbstractEventLoop, producer: Producer, num_tokens: int) -> tuple[float, list[float]]:
    async def one() -> tuple[float, list[float]]:
        started = time.perf_counter()
        tokens = producer.stream(loop, num_tokens)
        times = []
        for _ in range(num_tokens):
            await tokens.get()
            times.append(time.perf_counter())
        return times[0] - started, list(np.diff(times))

    return loop.run_until_complete(one())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args_list: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, *args_list], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{args_list} did not start")
    return proc


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=2.5, help="compute per token (the engine's decode step)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=24, help="requests per path per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--serve", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    ap.add_argument("--matmuls", type=int, default=0, help=argparse.SUPPRESS)  # servers: the parent's calibration
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "grpc_floor.json")
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), "" if args.serve[1] == "-" else args.serve[1], args.matmuls, args.tokens)
        return
    matmuls = matmuls_per_step(args.step_ms)
    producer_port, relay_port = free_port(), free_port()
    common = ["--matmuls", str(matmuls), "--tokens", str(args.tokens)]
    procs = [start(["--serve", str(producer_port), "-", *common])]
    procs.append(start(["--serve", str(relay_port), f"127.0.0.1:{producer_port}", *common]))
    loop = asyncio.new_event_loop()
    producer = Producer(matmuls)
    calls = {"hop1": grpc.insecure_channel(f"127.0.0.1:{producer_port}").unary_stream(METHOD),
             "hop2": grpc.insecure_channel(f"127.0.0.1:{relay_port}").unary_stream(METHOD)}
    runners = {"direct": lambda: direct_run(loop, producer, args.tokens),
               "hop1": lambda: client_run(calls["hop1"]), "hop2": lambda: client_run(calls["hop2"])}
    try:
        for run in runners.values():  # warm-up: channels, threads, allocator
            for _ in range(3):
                run()
        repeats = []
        for _ in range(args.repeats):
            per_path: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runners}
            for _ in range(args.requests):
                for name, run in runners.items():
                    ttft, gaps = run()
                    per_path[name][0].append(ttft)
                    per_path[name][1].extend(gaps)
            row = {}
            for name in ("hop1", "hop2"):
                paired = [a - b for a, b in zip(per_path[name][0], per_path["direct"][0])]
                row[name] = {
                    "added_ttft_p50_ms": pct(paired, 50), "added_ttft_p99_ms": pct(paired, 99),
                    "added_itl_p50_ms": pct(per_path[name][1], 50) - pct(per_path["direct"][1], 50),
                    "added_itl_p99_ms": pct(per_path[name][1], 99) - pct(per_path["direct"][1], 99),
                }
            row["direct"] = {"itl_p50_ms": pct(per_path["direct"][1], 50), "itl_p99_ms": pct(per_path["direct"][1], 99),
                             "ttft_p50_ms": pct(per_path["direct"][0], 50)}
            row["loadavg"] = os.getloadavg()[0]
            repeats.append(row)
    finally:
        for proc in procs:
            proc.kill()
    summary = {name: {key: statistics.median(r[name][key] for r in repeats) for key in repeats[0][name]}
               for name in ("direct", "hop1", "hop2")}
    table = Table(title=f"Bare gRPC stream hops, median of {args.repeats} repeats (ms)")
    for column in ("path", "added TTFT p50", "added TTFT p99", "added ITL p50", "added ITL p99"):
        table.add_column(column, justify="right")
    for name, label in (("hop1", "1 hop (server -> client)"), ("hop2", "2 hops (server -> relay -> client)")):
        s = summary[name]
        table.add_row(label, f"{s['added_ttft_p50_ms']:.3f}", f"{s['added_ttft_p99_ms']:.3f}",
                      f"{s['added_itl_p50_ms']:.3f}", f"{s['added_itl_p99_ms']:.3f}")
    console = Console()
    console.print(f"direct: TTFT p50 {summary['direct']['ttft_p50_ms']:.2f} ms, ITL p50 / p99 "
                  f"{summary['direct']['itl_p50_ms']:.2f} / {summary['direct']['itl_p99_ms']:.2f} ms; "
                  f"load averages {[round(r['loadavg'], 2) for r in repeats]}")
    console.print(table)
    report = {"benchmark": "grpc_floor", "command": " ".join(sys.argv),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version(), "grpcio": grpc.__version__},
              "config": {**{k: v for k, v in vars(args).items() if k not in ("serve", "out")}, "matmuls": matmuls},
              "summary": summary, "repeats": repeats}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
