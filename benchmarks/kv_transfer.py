"""KV transfer bandwidth between two worker processes: NIXL vs gRPC vs an in-process memcpy.

This process and a child it starts each own a paged KV cache (bf16, block-major, on huge
pages as a worker's) and the transports, registered in Redis under a private prefix. For
every size, randomly chosen blocks move parent -> child (push) and child -> parent (pull)
through (a) NixlTransport with one lane (the worker default), (a2) NixlTransport with two
lanes (the transfer split over two agents on two threads), and (b) GrpcTransport; every
push computes its sender digest on the clock, as a real push does. In-process baselines:
(c) `memcpy`, a plain memcpy (libc memmove, one thread) of the same number of contiguous
bytes — the issue's baseline — also on huge pages (`memcpy_hp`); (d) `torch_copy`, the
same copy by torch's copy_, which splits it over all its threads; and (e) `gather`, a
single-threaded copy of the very same randomly chosen blocks between two caches in this
process. All are measured right before and after each size's transfers, so they see the
same foreign load. Reported: median bandwidth over the repeats, NIXL push as % of each
baseline, the time until the receiver had every part in place (NIXL: notification +
digest of the written blocks), the longest event-loop stall seen while transfers ran,
and the foreign load (CPU used by other processes during the run, in cores).

    .venv/bin/python benchmarks/kv_transfer.py --sizes-mib 1,4,16,64,256 --out bench-results/kv_transfer.json
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from common import REPO

import grpc  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from splitserve.proto import worker_pb2_grpc  # noqa: E402
from splitserve.state.store import StateStore, WorkerInfo  # noqa: E402
from workers.engine.host_memory import zeros_on_huge_pages  # noqa: E402
from workers.kv_transfer.base import BlockTransfer, KvMemory, KvTransferError  # noqa: E402
from workers.kv_transfer.grpc_transport import KV_GRPC_OPTIONS, GrpcTransport  # noqa: E402
from workers.kv_transfer.nixl_transport import NixlTransport  # noqa: E402

console = Console(stderr=True)
MIB = 1 << 20
# One block: [layers, K/V, block_size, kv_heads, head_dim] in bf16 = 8*2*16*8*64*2 B = 256 KiB.
BLOCK_SHAPE = (8, 2, 16, 8, 64)
TIMEOUT_S = 120.0


def random_cache(num_blocks: int, seed: int) -> torch.Tensor:
    """Random bytes shaped as a bf16 KV cache (the transports move bytes, values do not matter)."""
    numel = num_blocks * torch.Size(BLOCK_SHAPE).numel()
    generator = torch.Generator().manual_seed(seed)
    # Allocated as the worker allocates its CPU KV cache (model_runner.py): on huge pages.
    cache = zeros_on_huge_pages((numel * 2,), torch.uint8)
    cache.copy_(torch.randint(0, 256, (numel * 2,), dtype=torch.uint8, generator=generator))
    return cache.view(torch.bfloat16).view(num_blocks, *BLOCK_SHAPE)


class KvServicer(worker_pb2_grpc.WorkerServicer):
    """Worker.PushKv / PullKv over a GrpcTransport."""

    def __init__(self, transport: GrpcTransport):
        self.transport = transport

    async def PushKv(self, request_iterator, context):
        return await self.transport.handle_push(request_iterator)

    async def PullKv(self, request, context):
        async for chunk in self.transport.handle_pull(request):
            yield chunk


class Worker:
    """One side of the benchmark: cache, store, both transports and a gRPC server."""

    def __init__(self, worker_id: str, memory: KvMemory, redis_url: str, prefix: str,
                 on_chunk: Callable[[BlockTransfer, bool], None], serve_lanes: int = 0):
        self.worker_id = worker_id
        self.memory = memory
        self.store = StateStore(redis_url, prefix=prefix)
        self.grpc = GrpcTransport(worker_id, memory, self.store, on_chunk)
        if serve_lanes:  # the child: one transport with every lane a parent transport may use
            self.nixl = NixlTransport(worker_id, memory, self.store, on_chunk, lanes=serve_lanes)
            self.nixl2 = None
        else:  # the parent: one lane (the worker default), and two lanes as a second worker id
            self.nixl = NixlTransport(worker_id, memory, self.store, on_chunk)
            self.nixl2 = NixlTransport(f"{worker_id}-2lanes", memory, self.store, on_chunk, lanes=2)
        self.server = grpc.aio.server(options=KV_GRPC_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(KvServicer(self.grpc), self.server)

    async def start(self) -> None:
        await self.store.connect()
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        await self.nixl.start()
        if self.nixl2 is not None:
            await self.nixl2.start()
        await self.store.register_worker(WorkerInfo(self.worker_id, f"127.0.0.1:{port}"), ttl_s=3600)

    async def stop(self) -> None:
        await self.nixl.close()
        if self.nixl2 is not None:
            await self.nixl2.close()
        await self.grpc.close()
        await self.server.stop(grace=None)
        await self.store.deregister_worker(self.worker_id)
        await self.store.close()


# ---- the child process ---------------------------------------------------------------

async def serve_peer(args: argparse.Namespace) -> None:
    """Child: serve transfers until stdin closes; report every on_chunk as a JSON line."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL logs to stdout; keep the protocol channel clean

    def on_chunk(chunk: BlockTransfer, ok: bool) -> None:
        protocol.write(json.dumps({"event": "chunk", "transfer_id": chunk.transfer_id,
                                   "token_start": chunk.token_start, "token_end": chunk.token_end, "ok": ok}) + "\n")

    worker = Worker(args.worker_id, KvMemory(random_cache(args.num_blocks, seed=2)), args.redis_url,
                    args.prefix, on_chunk, serve_lanes=2)
    await worker.start()
    # As PrepareKv does for a real stage: announce the pushes, so the receiver polls for
    # their notifications at its fast rate rather than its idle one.
    worker.nixl.expect_incoming("benchmark", 3600.0)
    protocol.write(json.dumps({"event": "ready"}) + "\n")
    await asyncio.to_thread(sys.stdin.read)  # EOF: the parent is done
    await worker.stop()


class ChildEvents:
    """The child's JSON lines, readable from the parent's event loop."""

    def __init__(self, proc: subprocess.Popen):
        self._events: dict[str, dict[str, Any]] = {}
        self._arrived: dict[str, tuple[int, bool]] = {}  # transfer id -> (tokens in place, all intact)
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            event = json.loads(line)
            with self._changed:
                key = event["event"]
                if "transfer_id" in event:
                    # Chunks (gRPC) and lane parts (NIXL) land in any order; the key names how
                    # many tokens of the transfer are in place so far: "<id>@<tokens>".
                    tokens, ok = self._arrived.get(event["transfer_id"], (0, True))
                    tokens, ok = tokens + event["token_end"] - event["token_start"], ok and event["ok"]
                    self._arrived[event["transfer_id"]] = (tokens, ok)
                    key, event = f"{event['transfer_id']}@{tokens}", {**event, "ok": ok}
                self._events[key] = event
                self._changed.notify_all()

    def wait(self, key: str, timeout_s: float) -> dict[str, Any]:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._events, timeout_s):
                raise TimeoutError(f"no event {key!r} from the child within {timeout_s}s")
            return self._events.pop(key)


# ---- measurements ----------------------------------------------------------------------

class LoopStallMeter:
    """The longest gap beyond 1 ms between ticks of a 1 ms asyncio timer."""

    def __init__(self) -> None:
        self.max_stall_s = 0.0
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.001)
            self.max_stall_s = max(self.max_stall_s, loop.time() - before - 0.001)

    def __enter__(self) -> LoopStallMeter:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._task.cancel()


async def timed(repeats: int, run: Callable[[int], Awaitable[float | None]]) -> list[float]:
    """Seconds per repeat (run returns its own measure, or None to be timed whole); one warm-up first."""
    await run(-1)
    samples = []
    for i in range(repeats):
        started = time.perf_counter()
        measured = await run(i)
        samples.append(measured if measured is not None else time.perf_counter() - started)
    return samples


def memcpy_seconds(num_bytes: int, repeats: int, kind: str = "libc", huge_pages: bool = False) -> list[float]:
    """One in-process copy of num_bytes contiguous bytes, timed `repeats` times.

    kind "libc": a plain memcpy (ctypes.memmove, one thread) — the issue's baseline;
    kind "torch": torch's copy_, which splits one copy over all its threads.
    """
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    if huge_pages:  # the same memory kind as the KV caches the transports move
        src = zeros_on_huge_pages((num_bytes,), torch.uint8).copy_(src)
    dst = zeros_on_huge_pages((num_bytes,), torch.uint8) if huge_pages else torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages
    if kind == "libc":
        def copy() -> None:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), num_bytes)
    else:
        def copy() -> None:
            dst.copy_(src)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        copy()
        samples.append(time.perf_counter() - started)
    return samples


def gather_seconds(memory: KvMemory, src: tuple[int, ...], dst: tuple[int, ...], repeats: int) -> list[float]:
    """One thread copying the same block pairs between two caches of this process (plain memcpy per block)."""
    import numpy as np

    source = memory.tensor.view(-1).view(torch.uint8).view(memory.num_blocks, memory.block_bytes).numpy()
    target = np.empty_like(source)
    target[:] = 0  # first touch
    samples = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for s, d in zip(src, dst):
            target[d] = source[s]
        samples.append(time.perf_counter() - started)
    return samples[1:]


class ForeignLoad:
    """CPU used by every other process on the machine while the block runs, in cores."""

    def __init__(self, own_pids: Callable[[], list[int]]):
        self._own_pids = own_pids

    @staticmethod
    def _busy_ticks() -> int:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    @staticmethod
    def _process_ticks(pid: int) -> int:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0
        return int(stat[11]) + int(stat[12])  # utime + stime

    def __enter__(self) -> ForeignLoad:
        self._pids = self._own_pids()
        self._started = time.monotonic()
        self._busy = self._busy_ticks()
        self._own = sum(self._process_ticks(pid) for pid in self._pids)
        self._loadavg = os.getloadavg()[0]
        return self

    def __exit__(self, *exc_info: object) -> None:
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        elapsed = time.monotonic() - self._started
        busy = self._busy_ticks() - self._busy
        own = sum(self._process_ticks(pid) for pid in self._pids) - self._own
        self.cores = max(0.0, (busy - own) / ticks_per_s / elapsed)
        self.loadavg = (self._loadavg, os.getloadavg()[0])


async def measure_size(parent: Worker, child_id: str, events: ChildEvents, size_mib: int, repeats: int,
                       rng: random.Random) -> dict[str, Any]:
    num_bytes = size_mib * MIB
    count = num_bytes // parent.memory.block_bytes
    tokens = count * parent.memory.block_size
    result: dict[str, Any] = {"size_mib": size_mib, "blocks": count}
    src = tuple(rng.sample(range(parent.memory.num_blocks), count))
    dst = tuple(rng.sample(range(parent.memory.num_blocks), count))
    baselines = {"memcpy": ("libc", False), "memcpy_hp": ("libc", True), "torch_copy": ("torch", False)}
    copies = {name: await asyncio.to_thread(memcpy_seconds, num_bytes, repeats, *how)
              for name, how in baselines.items()}
    gather = await asyncio.to_thread(gather_seconds, parent.memory, src, dst, repeats)
    for name in ("nixl", "nixl2", "grpc"):
        transport = getattr(parent, name)
        delivered: list[float] = []
        with LoopStallMeter() as stall:  # only the transport's own work is on the clock

            async def push(i: int) -> float:
                tid = f"{name}-{size_mib}-{i}-{uuid.uuid4().hex[:6]}"
                transfer = BlockTransfer(tid, transport.worker_id, child_id, src, dst, 0, tokens)
                started = time.perf_counter()
                await transport.push(transfer, None, TIMEOUT_S)  # the sender's digest is on the clock
                pushed = time.perf_counter() - started
                event = await asyncio.to_thread(events.wait, f"{tid}@{tokens}", TIMEOUT_S)
                if not event["ok"]:
                    raise KvTransferError(f"{tid} arrived corrupted")
                if i >= 0:
                    delivered.append(time.perf_counter() - started)
                return pushed

            async def pull(i: int) -> None:
                transfer = BlockTransfer(f"{name}-pull-{i}", child_id, transport.worker_id, dst, src, 0, tokens)
                await transport.pull(transfer, TIMEOUT_S)

            result[f"{name}_push_s"] = statistics.median(await timed(repeats, push))
            result[f"{name}_delivered_s"] = statistics.median(delivered)
            result[f"{name}_pull_s"] = statistics.median(await timed(repeats, pull))
        result[f"{name}_max_loop_stall_ms"] = stall.max_stall_s * 1e3
    for name, how in baselines.items():
        copies[name] += await asyncio.to_thread(memcpy_seconds, num_bytes, repeats, *how)
        result[f"{name}_s"] = statistics.median(copies[name])
    gather += await asyncio.to_thread(gather_seconds, parent.memory, src, dst, repeats)
    result["gather_s"] = statistics.median(gather)
    for key in [k for k in result if k.endswith("_s")]:
        result[key.removesuffix("_s") + "_gbps"] = num_bytes / result[key] / 1e9
    for baseline in ("memcpy", "memcpy_hp", "torch_copy", "gather"):
        for name in ("nixl", "nixl2"):
            for op in ("push", "pull"):
                ratio = result[f"{name}_{op}_gbps"] / result[f"{baseline}_gbps"]
                result[f"{name}_{op}_pct_of_{baseline}"] = 100 * ratio
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    table = Table(title="KV transfer between two processes (GB/s, median)")
    columns = [("MiB", "size_mib", "{}"), ("NIXL push", "nixl_push_gbps", "{:.2f}"),
               ("NIXL delivered", "nixl_delivered_gbps", "{:.2f}"), ("NIXL pull", "nixl_pull_gbps", "{:.2f}"),
               ("NIXL 2 lanes push", "nixl2_push_gbps", "{:.2f}"), ("NIXL 2 lanes pull", "nixl2_pull_gbps", "{:.2f}"),
               ("gRPC push", "grpc_push_gbps", "{:.2f}"), ("gRPC pull", "grpc_pull_gbps", "{:.2f}"),
               ("memcpy", "memcpy_gbps", "{:.2f}"), ("memcpy huge pages", "memcpy_hp_gbps", "{:.2f}"),
               ("torch copy", "torch_copy_gbps", "{:.2f}"), ("gather", "gather_gbps", "{:.2f}"),
               ("NIXL push % memcpy", "nixl_push_pct_of_memcpy", "{:.0f}%"),
               ("NIXL push % memcpy huge pages", "nixl_push_pct_of_memcpy_hp", "{:.0f}%"),
               ("NIXL push % torch copy", "nixl_push_pct_of_torch_copy", "{:.0f}%"),
               ("NIXL 2 lanes push % memcpy", "nixl2_push_pct_of_memcpy", "{:.0f}%"),
               ("NIXL push % gather", "nixl_push_pct_of_gather", "{:.0f}%"),
               ("NIXL pull % gather", "nixl_pull_pct_of_gather", "{:.0f}%"),
               ("NIXL loop stall ms", "nixl_max_loop_stall_ms", "{:.1f}"),
               ("gRPC loop stall ms", "grpc_max_loop_stall_ms", "{:.1f}"),
               ("foreign load (cores)", "foreign_load_cores", "{:.2f}")]
    for title, _, _ in columns:
        table.add_column(title, justify="right")
    for row in results:
        table.add_row(*(fmt.format(row[key]) for _, key, fmt in columns))
    Console().print(table)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    block_bytes = torch.Size(BLOCK_SHAPE).numel() * 2
    num_blocks = max(sizes) * MIB // block_bytes
    prefix = f"ss:bench-kv-{uuid.uuid4().hex[:8]}:"
    child_id = "bench-child"
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-peer", "--worker-id", child_id, "--redis-url", args.redis_url,
         "--prefix", prefix, "--num-blocks", str(num_blocks)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.DEVNULL,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    events = ChildEvents(child)
    parent = Worker("bench-parent", KvMemory(random_cache(num_blocks, seed=1)), args.redis_url, prefix,
                    lambda chunk, ok: None)
    try:
        await parent.start()
        await asyncio.to_thread(events.wait, "ready", 60)
        rng = random.Random(0)
        results = []
        for size in sizes:
            console.log(f"{size} MiB ...")
            with ForeignLoad(lambda: [os.getpid(), child.pid]) as load:
                results.append(await measure_size(parent, child_id, events, size, args.repeats, rng))
            results[-1]["foreign_load_cores"] = load.cores
            results[-1]["loadavg_1m"] = load.loadavg
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
        await parent.stop()
    return {
        "benchmark": "kv_transfer",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "config": {"sizes_mib": sizes, "repeats": args.repeats, "block_bytes": block_bytes,
                   "block_shape": list(BLOCK_SHAPE), "dtype": "bfloat16", "blocks": "random, non-contiguous",
                   "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}},
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "kv_transfer.json"))
    parser.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--verbose", action="store_true", help="show the child's logs")
    parser.add_argument("--serve-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-id", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_peer:
        asyncio.run(serve_peer(args))
        return
    report = asyncio.run(run_benchmark(args))
    print_table(report["results"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.log(f"wrote {out}")


if __name__ == "__main__":
    main()
