"""How much KV transfer chunked push hides behind computation (DynaServe §4.3).

A long prompt is split at the end of the prompt (alpha = prefill, beta = decode) on a
real two-worker cluster. Each worker measures the transfer time that is *not* hidden:
from alpha's stage end to its last KV chunk being in place on beta. We compare chunked
push (a chunk every `--chunk-tokens` while alpha computes) with one transfer after the
stage ends, for each transport, in the same run. For NIXL, chunked push runs twice: with
the last step's chunk pushed whole after the step (`--kv-layer-push false`) and layer by
layer from inside it (issue 12). `--repeats` runs every configuration that many times,
interleaved; medians are reported.

    .venv/bin/python benchmarks/kv_overlap.py --out bench-results/kv_overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import httpx
from rich.console import Console
from rich.table import Table

from common import REPO  # noqa: E402

from splitserve.client import Client  # noqa: E402
from splitserve.cli.demo_model import bench_model_spec, build_demo_model  # noqa: E402
from splitserve.cli.launcher import ClusterSpec, start_cluster  # noqa: E402
from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from splitserve.redis_server import free_port  # noqa: E402

console = Console()
SINGLE_TRANSFER = 1 << 30  # a chunk larger than any stage: everything goes after it ends


def _scrape(port: int, name: str) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
    count = re.search(rf"^{name}_count (\S+)$", text, re.M)
    return (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)


def measure(model_dir: Path, transport: str, chunk_tokens: int, prompt_len: int, requests: int,
            redis_url: str, step_tokens: int, layer_push: bool = False) -> dict:
    import grpc

    spec = ClusterSpec(
        model=str(model_dir), workers=2, policy="split", http_port=free_port(), grpc_port=free_port(),
        redis_url=redis_url, redis_prefix=f"ss:overlap-{uuid.uuid4().hex[:8]}:",
        worker_args={"kv_transport": transport, "kv_layer_push": layer_push,
                     "kv_cache_memory_bytes": 512 << 20, "max_num_batched_tokens": step_tokens,
                     "log_level": os.environ.get("SPLITSERVE_BENCH_LOG_LEVEL", "INFO")},
        coordinator_args={"kv_chunk_tokens": chunk_tokens},
        log_dir=Path(os.environ.get("SPLITSERVE_BENCH_LOG_DIR", "/tmp/splitserve-kv-overlap-logs")),
    )
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(spec)
    try:
        max_tokens = 4
        total = prompt_len + max_tokens
        with grpc.insecure_channel(cluster.scheduler_address) as channel:
            scheduler_pb2_grpc.GlobalSchedulerStub(channel).SetPolicy(scheduler_pb2.SetPolicyRequest(
                policy="split", params={"split_ratio": repr((prompt_len - 0.5) / total)}), timeout=5)

        def prompt(seed: int) -> list[int]:
            # A different prompt every request: a repeated one would be a prefix-cache hit on
            # alpha, whose whole KV is then "computed" in its first step and pushed after it.
            return [(i * 7919 + seed * 104729) % 250 + 1 for i in range(prompt_len)]

        def totals() -> tuple[float, float, float]:
            exposed = pushed = stages = 0.0
            for child in cluster.children:
                if child.name.startswith("worker"):
                    s, c = _scrape(child.metrics_port, "splitserve_worker_kv_exposed_seconds")
                    exposed, stages = exposed + s, stages + c
                    pushed += _scrape(child.metrics_port, "splitserve_worker_kv_push_seconds")[0]
            return exposed, pushed, stages

        with Client(cluster.gateway_grpc, timeout_s=600) as client:
            # Warm-up: the first transfer to a peer sets up its connection (tens of ms).
            client.generate(prompt(requests)[:64], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            before = totals()
            started = time.perf_counter()
            for seed in range(requests):
                client.generate(prompt(seed), max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            wall = time.perf_counter() - started
        after = totals()
        exposed, pushed, stages = (a - b for a, b in zip(after, before))
    finally:
        cluster.stop()
    return {"transport": transport, "chunk_tokens": chunk_tokens, "layer_push": layer_push, "requests": requests,
            "stages_measured": stages,
            "exposed_s_per_request": exposed / max(stages, 1), "push_busy_s_per_request": pushed / max(stages, 1),
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--step-tokens", type=int, default=256, help="worker max_num_batched_tokens")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--transports", default="nixl,grpc")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every configuration, interleaved; medians")
    ap.add_argument("--no-layer-push", action="store_true", help="NIXL: skip the per-layer configuration")
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "bench-llama")
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "kv_overlap.json")
    args = ap.parse_args()
    model_dir = build_demo_model(bench_model_spec(), args.model_dir)
    configs = []  # (row name, transport, chunk tokens, per-layer push)
    for transport in args.transports.split(","):
        configs.append((f"{transport}, chunked", transport, args.chunk_tokens, False))
        if transport == "nixl" and not args.no_layer_push:
            configs.append((f"{transport}, chunked + last step per layer", transport, args.chunk_tokens, True))
        configs.append((f"{transport}, one transfer", transport, SINGLE_TRANSFER, False))
    runs: dict[str, list[dict]] = {name: [] for name, *_ in configs}
    for _ in range(args.repeats):
        for name, transport, chunk, layer_push in configs:
            runs[name].append(measure(model_dir, transport, chunk, args.prompt_len, args.requests, args.redis_url,
                                      args.step_tokens, layer_push))
    rows = []
    for name, transport, chunk, layer_push in configs:
        if chunk == SINGLE_TRANSFER:
            continue
        single = runs[f"{transport}, one transfer"]
        hidden = [1 - c["exposed_s_per_request"] / s["exposed_s_per_request"] if s["exposed_s_per_request"] else 0.0
                  for c, s in zip(runs[name], single)]  # each repeat against the one-transfer run beside it
        rows.append({"transport": transport, "config": name, "layer_push": layer_push, "runs": runs[name],
                     "single_runs": single,
                     "exposed_ms_median": statistics.median(r["exposed_s_per_request"] for r in runs[name]) * 1e3,
                     "single_exposed_ms_median": statistics.median(r["exposed_s_per_request"] for r in single) * 1e3,
                     "hidden_fractions": hidden, "hidden_fraction": statistics.median(hidden)})
    table = Table("configuration", "exposed (ms)", "exposed, one transfer (ms)", "hidden, per repeat",
                  "hidden (median)")
    for r in rows:
        table.add_row(r["config"], f"{r['exposed_ms_median']:.2f}", f"{r['single_exposed_ms_median']:.1f}",
                      " / ".join(f"{h:.0%}" for h in r["hidden_fractions"]), f"{r['hidden_fraction']:.0%}")
    console.print(f"prompt {args.prompt_len} tokens in steps of {args.step_tokens}, split at the end of the prompt, "
                  f"chunk {args.chunk_tokens} tokens, {args.requests} requests per configuration, "
                  f"{args.repeats} repeat(s), medians")
    console.print(table)
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "prompt_len": args.prompt_len, "step_tokens": args.step_tokens, "chunk_tokens": args.chunk_tokens,
              "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
