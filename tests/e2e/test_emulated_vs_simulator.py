"""Cross-validation (issue 5): the same workload on an emulated cluster and on the simulator.

(a) a real cluster of processes (Redis, global scheduler, coordinator, gateway) with two
emulated workers of 4 x A100 x Llama-3.1-70B (their step times are slept: the default
`--perf-backend auto`, NVIDIA aiconfigurator's measured A100 data, ~66 ms for a 320-token
prefill, ~30 ms a decode step, so the model's time dominates this box's control-plane
milliseconds), measured by `splitserve bench` over gRPC; (b) `splitserve
simulate` of the same cluster shape, same workload, same seed (so the same arrival
offsets). p50 TTFT and p50 ITL must agree within 15%, and `bench compare` must read both.

The simulator's fixed control-plane delays (`--dispatch-ms`, `--stream-ms`) are
calibrated first from this cluster at rest: lone requests (median of 8 after 2 warm-ups),
whose TTFT minus the model's prefill time is what the gateway/coordinator/scheduler hops
cost on this machine (10-25 ms here; without it the simulator's p50 TTFT is ~12% low). The
loaded run's queueing and batching are then the simulator's own prediction.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid

import pytest
from typer.testing import CliRunner

from loadgen.cli import bench_app
from services.planner.cli import simulate_app
from splitserve.client import Client
from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.perf.backends import perf_model_for
from splitserve.redis_server import free_port

GPU, MODEL, TP = "A100", "llama-3.1-70b", 4
# What times the emulated workers' steps and the simulator's (both default to --perf-backend auto):
# the calibration below subtracts this model's prefill time, so it must be the same one.
PERF = perf_model_for(GPU, MODEL, TP)
WORKERS, MAX_NUM_SEQS = 2, 32
WORKLOAD = ["--shape", "P320/D48", "--num-requests", "48", "--arrival", "poisson:rate=4", "--seed", "5",
            "--slo-ttft-ms", "500", "--slo-itl-ms", "60"]
TOLERANCE = 0.15


def _invoke(app, *args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return result.output


@pytest.fixture(scope="module")
def emulated_cluster(tiny_model_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]),  # the gateway's tokenizer and vocabulary; no weights are read
        workers=WORKERS, policy="least_loaded", http_port=free_port(), grpc_port=free_port(),
        redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"], redis_prefix=f"ss:xval-{uuid.uuid4().hex[:8]}:",
        log_dir=tmp_path_factory.mktemp("xval-logs"),
        worker_args={"backend": "emulated", "gpu": GPU, "model_preset": MODEL, "tp": TP,
                     "max_num_seqs": MAX_NUM_SEQS},
    )
    cluster = start_cluster(spec)
    yield cluster
    cluster.stop()


def _idle_overhead_ms(cluster) -> float:
    """Median TTFT of lone requests minus the model's prefill time: the control plane's share."""
    prompt_len = 320
    extra = []
    with Client(cluster.gateway_grpc, timeout_s=30) as client:
        for i in range(10):  # the first two warm the channels between the services up: not counted
            prompt = [(i * 53 + j * 7) % 300 + 3 for j in range(prompt_len)]  # distinct: no prefix hit
            first = None
            started = time.perf_counter()
            for _chunk in client.stream(prompt, max_tokens=2, temperature=0.0, ignore_eos=True):
                first = time.perf_counter() - started if first is None else first
            if i >= 2:
                extra.append(first - PERF.prefill_time(0, prompt_len))
    return max(0.0, statistics.median(extra) * 1000)


def test_emulated_cluster_and_simulator_agree_on_p50_ttft_and_itl(emulated_cluster, tmp_path):
    overhead_ms = _idle_overhead_ms(emulated_cluster)
    assert overhead_ms < 40, f"control plane at rest costs {overhead_ms:.1f} ms per first token"

    real_dir, sim_dir = tmp_path / "emulated", tmp_path / "simulated"
    _invoke(bench_app, "--target", emulated_cluster.gateway_grpc, *WORKLOAD, "--no-progress",
            "--out-dir", str(real_dir))
    # The cluster's shape as `splitserve up --backend emulated` runs it: 16-token blocks, a 2,048-token
    # step budget, KV from the preset's memory at 90%, loads published every 100 ms.
    _invoke(simulate_app, *WORKLOAD, "--workers", str(WORKERS), "--gpu", GPU, "--model-preset", MODEL,
            "--tp", str(TP), "--policy", "least_loaded", "--max-num-seqs", str(MAX_NUM_SEQS),
            "--dispatch-ms", f"{overhead_ms * 2 / 3:.3f}", "--stream-ms", f"{overhead_ms / 3:.3f}",
            "--handoff-ms", "0", "--out-dir", str(sim_dir))

    real = json.loads((real_dir / "bench.json").read_text())["summary"]
    sim = json.loads((sim_dir / "simulate.json").read_text())["summary"]
    assert real["n_ok"] == sim["n_ok"] == 48
    shown = (f"TTFT p50 emulated {real['ttft']['p50'] * 1e3:.1f} ms vs simulated {sim['ttft']['p50'] * 1e3:.1f} ms; "
             f"ITL p50 {real['itl']['p50'] * 1e3:.2f} vs {sim['itl']['p50'] * 1e3:.2f} ms; "
             f"idle control-plane overhead {overhead_ms:.1f} ms")
    print(shown)
    for metric in ("ttft", "itl"):
        assert sim[metric]["p50"] == pytest.approx(real[metric]["p50"], rel=TOLERANCE), shown
    # Queueing is in play (TTFT p50 above a lone prefill), else this would only test the perf model.
    assert real["ttft"]["p90"] > PERF.prefill_time(0, 320) * 1.2, shown

    output = _invoke(bench_app, "compare", str(real_dir / "bench.json"), str(sim_dir / "simulate.json"))
    assert "TTFT p50" in output
