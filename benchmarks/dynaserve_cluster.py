"""DynaServe against colocation and disaggregation on a real 2-worker cluster (issue 12).

The simulator's evaluation (`benchmarks/dynaserve_eval.py`) says which system should win;
this runs the same comparison through the real services, as a user would: `start_cluster`
launches Redis, the global scheduler, the coordinator, the gateway and two workers, and
`splitserve bench` (a separate process, streaming through the gRPC gateway) sends Poisson
arrivals of one shape at a few rates. Per system and rate: SLO attainment (TTFT and the
request's own p99 inter-token gap, as §6.3 of the DynaServe paper defines it), goodput,
throughput and TTFT/TBT percentiles.

Two modes:

* ``--mode emulated`` (default): A100 × Qwen2.5-14B emulated workers (the real worker
  service, engine scheduler, block manager and KV reservations; each forward pass sleeps
  the preset's time), P2048/D512 at 1.5 and 3 req/s, SLO TTFT ≤ 20 s / p99 TBT ≤ 100 ms.
* ``--mode real``: two CPU workers running the real SmolLM2-135M-Instruct model, a small
  shape at two low rates, SLOs scaled to this machine. A direction check only: both
  workers share the same two cores, so disaggregation cannot add compute here.

Systems (the paper's three): colocated (`round_robin`, fcfs with a tuned prefill chunk),
1P1D (`pd_disaggregated`, one prefill and one decode worker) and DynaServe (`dynaserve`
placement + `slo_aware` local batching).

    flock /tmp/splitserve-bench.lock .venv/bin/python benchmarks/dynaserve_cluster.py --out-dir bench-results/dynaserve_cluster
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from splitserve.cli.launcher import ClusterSpec, start_cluster  # noqa: E402
from splitserve.redis_server import free_port  # noqa: E402

console = Console(stderr=True, width=200)


@dataclass(frozen=True)
class System:
    """One serving system: placement policy plus what its workers run."""

    name: str
    policy: str
    prefill_workers: int = 0
    batch_policy: str = "fcfs"
    chunk_tokens: int | None = None  # max_num_batched_tokens; None: the mode's default
    policy_params: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Mode:
    """The cluster and load of one mode."""

    shape: str
    rates: tuple[float, ...]
    requests: int
    slo_ttft_ms: float
    slo_itl_ms: float
    colocated_chunk: int
    worker_args: dict


def emulated_mode(args) -> Mode:
    return Mode(shape=args.shape or "P2048/D512", rates=tuple(args.rates or (1.5, 3.0)), requests=args.requests or 90,
                slo_ttft_ms=20_000, slo_itl_ms=100, colocated_chunk=512,
                worker_args={"backend": "emulated", "gpu": "A100", "model_preset": "qwen2.5-14b", "tp": 1,
                             "max_model_len": 8192, "max_num_seqs": 256})


def real_mode(args) -> Mode:
    # One decode step of SmolLM2 with a few sequences takes ~25-50 ms on one core here; the
    # ITL objective leaves room for a few prefill tokens beside the decodes, as 100 ms does on an A100.
    return Mode(shape=args.shape or "P512/D64", rates=tuple(args.rates or (0.3, 0.6)), requests=args.requests or 24,
                slo_ttft_ms=20_000, slo_itl_ms=args.real_itl_ms, colocated_chunk=256,
                worker_args={"backend": "real", "max_num_seqs": 16, "kv_cache_memory_bytes": 128 << 20})


def systems(mode_name: str) -> list[System]:
    perf = {"perf_model": "A100/qwen2.5-14b/1"} if mode_name == "emulated" else {}
    return [
        System("colocated", "round_robin"),
        System("1P1D", "pd_disaggregated", prefill_workers=1),
        System("DynaServe", "dynaserve", batch_policy="slo_aware", policy_params=perf),
    ]


def model_dir(mode_name: str, work: Path, max_model_len: int = 8192) -> Path:
    """The real SmolLM2 model (real mode), or a tiny config for emulated workers of that context."""
    if mode_name == "real":
        from splitserve.model_presets import DEFAULT_PRESET, ensure_preset_model

        return ensure_preset_model(DEFAULT_PRESET, work / DEFAULT_PRESET)
    # Emulated workers read only the config (vocabulary, max length, EOS) and the tokenizer.
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, vocab_size=259, max_position_embeddings=max_model_len)
    return build_demo_model(spec, work / "emulated-config", overwrite=True)


def run_bench(target: str, bench_args: list[str], run_dir: Path, timeout_s: float, what: str) -> dict:
    """`splitserve bench --target TARGET ...bench_args --out-dir RUN_DIR` in its own process; its summary."""
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--target", target, *bench_args, "--out-dir", str(run_dir)]
    console.print(f"[bold]{what}[/]: {' '.join(cmd[3:])}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    records = sorted(run_dir.glob("*.json"))
    if proc.returncode != 0 or not records:
        raise RuntimeError(f"bench failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(records[0].read_text())["summary"]


def run_system(system: System, mode: Mode, mode_name: str, model_path: Path, args, out_dir: Path) -> list[dict]:
    chunk = system.chunk_tokens or (mode.colocated_chunk if system.policy == "round_robin" else 2048)
    worker_args = {**mode.worker_args, "batch_policy": system.batch_policy, "max_num_batched_tokens": chunk}
    if system.batch_policy == "slo_aware":  # for requests without an SLO (bench sends one with each)
        worker_args["itl_slo_ms"] = mode.slo_itl_ms
    spec = ClusterSpec(
        model=str(model_path), workers=2, policy=system.policy, prefill_workers=system.prefill_workers,
        http_port=free_port(), grpc_port=free_port(), redis_url=args.redis_url,
        redis_prefix=f"ss:dynbench-{uuid.uuid4().hex[:8]}:", log_dir=out_dir / "logs" / system.name,
        worker_args=worker_args, scheduler_args={"policy_params": json.dumps(system.policy_params)},
        coordinator_args={"kv_chunk_tokens": 64})
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cluster = start_cluster(spec)
    startup_s = time.monotonic() - started
    rows = []
    try:
        for index, rate in enumerate(mode.rates):
            run_dir = out_dir / f"{system.name}-{rate:g}"
            # Each rate its own prompts (the same for every system): replaying the previous
            # rate's prompts on this cluster would hit its prefix cache and flatter later rates.
            seed = args.seed + index
            summary = run_bench(cluster.gateway_grpc, [
                "--shape", mode.shape, "--arrival", f"poisson:rate={rate}", "-n", str(mode.requests),
                "--seed", str(seed), "--slo-ttft-ms", str(mode.slo_ttft_ms), "--slo-itl-ms", str(mode.slo_itl_ms),
            ], run_dir, args.run_timeout_s, f"{system.name} at {rate:g} req/s")
            rows.append({"system": system.name, "policy": system.policy, "batch_policy": system.batch_policy,
                         "chunk_tokens": chunk, "rate": rate, "seed": seed, "startup_s": startup_s,
                         **_pick(summary)})
    finally:
        cluster.stop()
    return rows


def _pick(summary: dict) -> dict:
    def pct(dist: dict | None, key: str) -> float | None:
        return None if not dist or dist.get(key) is None else dist[key] * 1000

    return {"attainment": summary["slo_attainment"], "goodput_rps": summary["goodput_requests_per_s"],
            "throughput_tok_s": summary["output_token_throughput"], "failed": summary["n_failed"],
            "ttft_p50_ms": pct(summary.get("ttft"), "p50"), "ttft_p99_ms": pct(summary.get("ttft"), "p99"),
            "tbt_p99_p50_ms": pct(summary.get("tbt_p99"), "p50"), "tbt_p99_p99_ms": pct(summary.get("tbt_p99"), "p99")}


def _table(rows: list[dict], title: str) -> Table:
    table = Table("system", "rate", "attainment", "goodput req/s", "tok/s", "TTFT p50 / p99 ms",
                  "request p99 TBT: p50 / p99 ms", title=title)

    def ms(value):
        return "-" if value is None else f"{value:,.0f}"

    for r in rows:
        table.add_row(r["system"], f"{r['rate']:g}", f"{r['attainment']:.0%}", f"{r['goodput_rps']:.2f}",
                      f"{r['throughput_tok_s']:,.0f}", f"{ms(r['ttft_p50_ms'])} / {ms(r['ttft_p99_ms'])}",
                      f"{ms(r['tbt_p99_p50_ms'])} / {ms(r['tbt_p99_p99_ms'])}")
    return table


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == name]
        axes[0].plot([r["rate"] for r in mine], [r["attainment"] * 100 for r in mine], marker="o", label=name)
        axes[1].plot([r["rate"] for r in mine], [r["goodput_rps"] for r in mine], marker="o", label=name)
    axes[0].set(xlabel="Poisson rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    axes[1].set(xlabel="Poisson rate (req/s)", ylabel="goodput (req/s)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("emulated", "real"), default="emulated")
    ap.add_argument("--shape", help="P<prompt>/D<output> (default: emulated P2048/D512, real P512/D64)")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], help="comma list of req/s")
    ap.add_argument("--requests", type=int, help="requests per run (default: emulated 90, real 24)")
    ap.add_argument("--real-itl-ms", type=float, default=250.0, help="real mode: p99 TBT objective (ms)")
    ap.add_argument("--systems", default="colocated,1P1D,DynaServe", help="comma list of systems to run")
    ap.add_argument("--seed", type=int, default=0, help="prompts of the i-th rate: seed + i")
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--redis-url", default=os.environ.get("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench-results" / "dynaserve_cluster")
    args = ap.parse_args()
    mode = emulated_mode(args) if args.mode == "emulated" else real_mode(args)
    out_dir = args.out_dir / args.mode
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {name.strip() for name in args.systems.split(",")}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        model_path = model_dir(args.mode, Path(work))
        for system in systems(args.mode):
            if system.name in wanted:
                rows += run_system(system, mode, args.mode, model_path, args, out_dir)
    title = (f"2 workers, {args.mode} ({'A100 x Qwen2.5-14B' if args.mode == 'emulated' else 'SmolLM2-135M on CPU'}),"
             f" {mode.shape}, SLO TTFT <= {mode.slo_ttft_ms / 1000:g} s, p99 TBT <= {mode.slo_itl_ms:g} ms")
    console.print(_table(rows, title))
    record = {"benchmark": "dynaserve_cluster", "mode": args.mode, "command": " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "shape": mode.shape, "requests_per_run": mode.requests, "slo_ttft_ms": mode.slo_ttft_ms,
              "slo_itl_ms": mode.slo_itl_ms, "rows": rows, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                         time.gmtime())}
    (out_dir / "dynaserve_cluster.json").write_text(json.dumps(record, indent=2))
    _plot(rows, out_dir / "dynaserve_cluster.png", title)
    console.print(f"wrote {out_dir / 'dynaserve_cluster.json'} and {out_dir / 'dynaserve_cluster.png'}")


if __name__ == "__main__":
    main()
