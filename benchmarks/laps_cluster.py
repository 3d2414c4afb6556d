"""LAPS against PD baselines through the real services (issue 14): real CPU workers, or emulated GPUs.

The simulator's evaluation (`benchmarks/laps_eval.py`) says which system should win; this
runs the comparison through the real services: `start_cluster` launches Redis, the global
scheduler, the coordinator, the gateway and two workers serving SmolLM2-135M-Instruct (one
prefill, one decode), and `splitserve bench` (a separate process, streaming through the
gRPC gateway) sends Poisson arrivals of a short/long mix (three 32-token prompts to one of
1,024 tokens). Systems: vanilla PD (`pd_disaggregated`, fcfs chunked prefill) and LAPS
(`laps` placement + the `laps` local batch policy: with one prefill worker this is LAPS'
temporal mode). Per system and rate: TTFT p50/p90 of the short and of the long prompts,
SLO attainment (TTFT <= --slo-ttft-ms), throughput. Both workers share the machine's two
cores, so absolute numbers mean little; the direction is what is checked.

``--mode emulated``: the spatial mode through the real services: 3 emulated workers
(A100 × Qwen2.5-14B: the real worker service, scheduler and block manager, each forward
pass sleeping the preset's time), two prefill workers and one decode worker, as `splitserve
up --workers 3 --prefill-workers 2 --policy laps` runs them: the scheduler's pool controller
puts the prefill workers in a short and a long pool through `Worker.SetRole`. A mix of three
64-token prompts to one of 4,096, 16 output tokens, TTFT SLO 400 ms. Systems: vanilla PD
(round-robin prefills), LB router (least-loaded prefills), LAPS (`laps` placement and local
batching, both with the preset's performance model).

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/laps_cluster.py --out-dir bench-results/laps_cluster
    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/laps_cluster.py --mode emulated \
        --out-dir bench-results/laps_cluster_emulated
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from common import REPO

from benchmarks.dynaserve_cluster import console, model_dir, run_bench  # noqa: E402
from splitserve.cli.launcher import ClusterSpec, start_cluster  # noqa: E402
from splitserve.redis_server import free_port  # noqa: E402

PRESET = {"gpu": "A100", "model_preset": "qwen2.5-14b", "tp": 1}
MODES = {
    # shape lengths, output tokens, workers, prefill workers, default rates, TTFT SLO ms
    "real": dict(short=32, long=1024, output=8, workers=2, prefill=1, rates=[0.5, 1.0], slo_ms=1500.0),
    "emulated": dict(short=64, long=4096, output=16, workers=3, prefill=2, rates=[4.0, 8.0], slo_ms=400.0),
}


def systems(mode: str) -> dict[str, dict]:
    if mode == "real":
        return {"vanilla PD": dict(policy="pd_disaggregated", batch_policy="fcfs", params={}),
                "LAPS": dict(policy="laps", batch_policy="laps", params={})}
    perf = {"perf_model": f"{PRESET['gpu']}/{PRESET['model_preset']}/{PRESET['tp']}"}
    return {"vanilla PD": dict(policy="pd_disaggregated", batch_policy="fcfs", params={"prefill_routing": "round_robin"}),
            "LB router": dict(policy="pd_disaggregated", batch_policy="fcfs", params={}),
            "LAPS": dict(policy="laps", batch_policy="laps", params=perf)}


def per_class(run_dir: Path, slo_s: float, boundary: int) -> dict:
    record = json.loads(sorted(run_dir.glob("*.json"))[0].read_text())
    requests = record["requests"]
    out = {}
    for name, keep in (("short", lambda n: n < boundary), ("long", lambda n: n >= boundary)):
        ttft = np.array([r["ttft_s"] for r in requests if keep(r["prompt_len"]) and r.get("ttft_s") is not None])
        out[f"{name}_ttft_p50_ms"] = float(np.percentile(ttft, 50) * 1000) if len(ttft) else None
        out[f"{name}_ttft_p90_ms"] = float(np.percentile(ttft, 90) * 1000) if len(ttft) else None
    ok = [r for r in requests if r.get("ttft_s") is not None]
    out["attainment"] = sum(1 for r in ok if r["ttft_s"] <= slo_s) / max(1, len(requests))
    out["failed"] = len(requests) - len(ok)
    out["throughput_tok_s"] = record["summary"]["output_token_throughput"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=tuple(MODES), default="real")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], help="req/s (default: per mode)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--slo-ttft-ms", type=float, help="TTFT objective (default: real 1500, scaled to this "
                    "machine; emulated 400)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "laps_cluster")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    mode = MODES[args.mode]
    rates = args.rates or mode["rates"]
    slo_ms = args.slo_ttft_ms or mode["slo_ms"]
    model = model_dir(args.mode, args.out_dir / "model", max_model_len=32768)
    d, short, long = mode["output"], mode["short"], mode["long"]
    shape = f"P{short}/D{d},P{short}/D{d},P{short}/D{d},P{long}/D{d}"
    if args.mode == "real":
        worker_args = {"backend": "real", "max_num_seqs": 16, "kv_cache_memory_bytes": 128 << 20}
    else:
        worker_args = {"backend": "emulated", **PRESET, "max_num_seqs": 256, "max_model_len": 32768}
    rows = []
    for name, system in systems(args.mode).items():
        params = dict(system["params"])
        if system["policy"] == "laps":
            params["ttft_slo_ms"] = slo_ms
        batch_options = {"ttft_slo_ms": slo_ms} if system["batch_policy"] == "laps" else {}
        spec = ClusterSpec(
            model=str(model), workers=mode["workers"], policy=system["policy"], prefill_workers=mode["prefill"],
            http_port=free_port(), grpc_port=free_port(), redis_url=args.redis_url,
            redis_prefix=f"ss:lapsbench-{uuid.uuid4().hex[:8]}:",
            log_dir=args.out_dir / "logs" / name.replace(" ", "_"),
            worker_args={**worker_args, "batch_policy": system["batch_policy"], "max_num_batched_tokens": 2048,
                         "batch_policy_options": json.dumps(batch_options)},
            scheduler_args={"policy_params": json.dumps(params)},
            coordinator_args={"kv_chunk_tokens": 64})
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        cluster = start_cluster(spec)
        try:
            for index, rate in enumerate(rates):
                run_dir = args.out_dir / f"{name.replace(' ', '_')}-{rate:g}"
                run_bench(cluster.gateway_grpc, [
                    "--shape", shape, "--arrival", f"poisson:rate={rate}", "-n", str(args.requests),
                    "--seed", str(args.seed + index), "--slo-ttft-ms", str(slo_ms), "--per-request",
                ], run_dir, args.run_timeout_s, f"{name} at {rate:g} req/s")
                row = {"system": name, "rate": rate, **per_class(run_dir, slo_ms / 1000, (short + long) // 2)}
                rows.append(row)
                console.print(row)
        finally:
            cluster.stop()
    results = {"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "shape": shape,
               "mode": args.mode, "slo_ttft_ms": slo_ms,
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "at": time.time()}
    (args.out_dir / "laps_cluster.json").write_text(json.dumps(results, indent=1))
    print("| system | rate | short TTFT p50 / p90 ms | long TTFT p50 / p90 ms | attainment | failed | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        def ms(key):
            return "–" if r[key] is None else f"{r[key]:.0f}"
        print(f"| {r['system']} | {r['rate']:g} | {ms('short_ttft_p50_ms')} / {ms('short_ttft_p90_ms')} | "
              f"{ms('long_ttft_p50_ms')} / {ms('long_ttft_p90_ms')} | {r['attainment']:.0%} | {r['failed']} | "
              f"{r['throughput_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
