"""Where a token's CPU goes on its way to the client: py-spy on every `splitserve up` process under load.

Starts `splitserve up --workers 1` (the default topology, or the flags after `--up-args`),
warms it up, then keeps `--concurrency` streamed requests in flight (the same client and
requests as `benchmarks/serve_vs_vllm.py`) while py-spy samples each service process
(`--threads --idle` off: only samples where a thread is on the CPU). Prints, per process
and thread, the share of its on-CPU samples in each of the frames that matter (the engine's
forward, scheduling, sampling, gRPC streaming, HTTP/SSE, detokenizing, Redis), and writes
the raw collapsed stacks (flamegraph input) next to the JSON.

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/serve_profile.py \\
        --out bench-results/serve_profile.json

py-spy (`pip install py-spy`) must be on PATH or in the venv; it needs ptrace rights over the
processes (root, or kernel.yama.ptrace_scope=0).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO

from serve_vs_vllm import bench, free_port, machine, process_tree, splitserve_server, role_of  # noqa: E402

# Frames whose inclusive share is reported: (label, substring of a frame "function (file)").
FRAMES = [
    ("engine step (all)", "step (workers/engine/engine.py"),
    ("  model forward", "execute (workers/engine/model_runner.py"),
    ("  scheduling", "schedule (splitserve/core/scheduler.py"),
    ("  sampling", "sample (workers/engine/sampler.py"),
    ("worker stage stream (per chunk)", "stream (workers/stage_call.py"),
    ("worker publishing load to Redis", "publish_load (workers/server.py"),
    ("gRPC (grpc.aio internals)", "grpc/_cython"),
    ("coordinator relay", "submit (services/coordinator/core.py"),
    ("gateway: generate", "generate (gateway/core.py"),
    ("gateway: SSE events", "_sse_events (gateway/http_api.py"),
    ("detokenizer", "splitserve/detokenizer.py"),
    ("tokenizer + chat template", "gateway/tokenization.py"),
    ("Redis client", "redis/asyncio"),
    ("uvicorn/starlette", "starlette"),
    ("cluster view refresh", "view.py"),
]


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def summarize(raw: Path) -> dict:
    """Collapsed stacks ("thread;frame;frame count" per line) -> per-thread totals and frame shares."""
    per_thread: dict[str, int] = collections.Counter()
    frames: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        parts = stack.split(";")
        # "thread (id): name" with --threads; the engine's Python thread is named engine-loop.
        head = parts[0] if parts else "?"
        thread = head.split("): ", 1)[1] if "): " in head else head
        per_thread[thread] += n
        seen = set()
        for label, needle in FRAMES:
            if label not in seen and any(needle in p for p in parts):
                frames[thread][label] += n
                seen.add(label)
    return {thread: {"samples": total, "shares": {label: frames[thread][label] / total
                                                   for label, _ in FRAMES if frames[thread][label]}}
            for thread, total in per_thread.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    ap.add_argument("--topology", default="default", help="a topology of serve_vs_vllm.TOPOLOGIES")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--api", choices=("chat", "completions"), default="chat",
                    help="what the client streams (as serve_vs_vllm.py)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--out", default=str(REPO / "bench-results/serve_profile.json"))
    args = ap.parse_args()

    spy = py_spy()
    log_dir = Path(tempfile.mkdtemp(prefix="serve_profile-"))
    server = splitserve_server(args.topology, args.model, free_port(), log_dir, 64)
    server.start(300)
    result: dict = {"command": " ".join(sys.argv), "machine": machine(), "args": vars(args)}
    try:
        bench(server, args, 8, 4, seed=1000)  # warm-up
        pids = {role_of(pid): pid for pid in process_tree(server.process.pid)}
        services = {role: pid for role, pid in pids.items() if role in ("gateway", "coordinator", "worker")}
        load_done = threading.Event()
        load: dict = {}

        def drive() -> None:
            # Enough requests to outlast the sampling window.
            n = max(args.concurrency, int(args.seconds * 6))
            load.update(bench(server, args, n, args.concurrency, seed=7))
            load_done.set()

        threading.Thread(target=drive, daemon=True).start()
        time.sleep(2.0)  # let the load reach steady state before sampling (not synchronisation)
        spies = {}
        for role, pid in services.items():
            raw = Path(args.out).with_name(f"serve_profile-{role}.txt")
            spies[role] = (raw, subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)), "--rate", str(args.rate),
                 "--format", "raw", "--threads", "--output", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for role, (raw, proc) in spies.items():
            proc.wait(timeout=args.seconds + 60)
            result[role] = summarize(raw)
        load_done.wait(timeout=600)
        result["load"] = {k: v for k, v in load.items() if k not in ("cpu_s",)}
    finally:
        server.stop()
    for role in ("gateway", "coordinator", "worker"):
        if role not in result:
            continue
        print(f"\n{role}: share of each thread's on-CPU samples")
        for thread, data in sorted(result[role].items(), key=lambda kv: -kv[1]["samples"]):
            shares = ", ".join(f"{label.strip()} {share:.0%}" for label, share in data["shares"].items())
            print(f"  {thread:<12} {data['samples']:>6} samples: {shares}")
    print(f"\nload: {result['load'].get('output_tok_s', 0):.1f} tok/s; CPU ms per token: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["load"].get("cpu_ms_per_token", {}).items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
