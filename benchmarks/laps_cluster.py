"""LAPS against vanilla PD on 2 real CPU workers with the real model: a direction check (issue 14).

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

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/laps_cluster.py --out-dir bench-results/laps_cluster
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from dynaserve_cluster import console, model_dir, run_bench  # noqa: E402

from splitserve.launcher import ClusterSpec, start_cluster  # noqa: E402
from splitserve.redis_server import free_port  # noqa: E402

SHORT_LEN, LONG_LEN = 32, 1024
SYSTEMS = {"vanilla PD": dict(policy="pd_disaggregated", batch_policy="fcfs"),
           "LAPS": dict(policy="laps", batch_policy="laps")}


def per_class(run_dir: Path, slo_s: float) -> dict:
    record = json.loads(sorted(run_dir.glob("*.json"))[0].read_text())
    requests = record["requests"]
    out = {}
    for name, keep in (("short", lambda n: n < 256), ("long", lambda n: n >= 256)):
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
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--slo-ttft-ms", type=float, default=1500.0, help="TTFT objective, scaled to this machine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "laps_cluster")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir("real", args.out_dir / "model")
    d = args.output_tokens
    shape = f"P{SHORT_LEN}/D{d},P{SHORT_LEN}/D{d},P{SHORT_LEN}/D{d},P{LONG_LEN}/D{d}"
    rows = []
    for name, system in SYSTEMS.items():
        spec = ClusterSpec(
            model=str(model), workers=2, policy=system["policy"], prefill_workers=1, http_port=free_port(),
            grpc_port=free_port(), redis_url=args.redis_url, redis_prefix=f"ss:lapsbench-{uuid.uuid4().hex[:8]}:",
            log_dir=args.out_dir / "logs" / name.replace(" ", "_"),
            worker_args={"backend": "real", "max_num_seqs": 16, "kv_cache_memory_bytes": 128 << 20,
                         "batch_policy": system["batch_policy"], "max_num_batched_tokens": 2048},
            scheduler_args={"policy_params": json.dumps({"ttft_slo_ms": args.slo_ttft_ms}
                                                        if system["policy"] == "laps" else {})},
            coordinator_args={"kv_chunk_tokens": 64})
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        cluster = start_cluster(spec)
        try:
            for index, rate in enumerate(args.rates):
                run_dir = args.out_dir / f"{name.replace(' ', '_')}-{rate:g}"
                run_bench(cluster.gateway_grpc, [
                    "--shape", shape, "--arrival", f"poisson:rate={rate}", "-n", str(args.requests),
                    "--seed", str(args.seed + index), "--slo-ttft-ms", str(args.slo_ttft_ms), "--per-request",
                ], run_dir, args.run_timeout_s, f"{name} at {rate:g} req/s")
                row = {"system": name, "rate": rate, **per_class(run_dir, args.slo_ttft_ms / 1000)}
                rows.append(row)
                console.print(row)
        finally:
            cluster.stop()
    results = {"rows": rows, "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "shape": shape,
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
