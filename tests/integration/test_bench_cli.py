"""`bench` against the real local cluster: gRPC and OpenAI HTTP targets, sessions, compare."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from loadgen.cli import bench_app

RUN_ARGS = ["--shape", "P32/D8", "--num-requests", "12", "--arrival", "poisson:rate=20", "--per-request",
            "--no-progress", "--seed", "7"]


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(bench_app, list(args))
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return result.output


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """One short run per target kind; the output directories by kind."""
    out = {}
    for kind, address in (("grpc", cluster.gateway_grpc), ("http", f"{cluster.gateway_http}/v1")):
        out[kind] = tmp_path_factory.mktemp(f"bench-{kind}")
        _invoke("--target", address, *RUN_ARGS, "--out-dir", str(out[kind]))
    return out


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_short_run_writes_every_output(runs, kind):
    out = runs[kind]
    for name in ("bench.json", "bench.csv", "bench_latency_cdf.png", "bench_timeline.png"):
        assert (out / name).stat().st_size > 0, name
    record = json.loads((out / "bench.json").read_text())
    summary = record["summary"]
    assert summary["n_requests"] == 12 and summary["n_ok"] == 12 and summary["n_failed"] == 0
    assert [r["output_len"] for r in record["requests"]] == [8] * 12
    assert all(r["prompt_len"] == 32 and 1 <= len(r["token_times_s"]) <= 8 for r in record["requests"])
    if kind == "grpc":
        # gRPC shows every token id; OpenAI text deltas hide tokens that decode to no text.
        assert all(len(r["token_times_s"]) == 8 for r in record["requests"])
        assert summary["itl"]["count"] == 12 * 7
    assert summary["ttft"]["count"] == 12
    assert record["config"]["target"]["model"] and record["config"]["vocab_size"] == 256
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert len(rows) == 12 and all(r["ok"] == "True" and r["output_len"] == "8" for r in rows)


def test_compare_grpc_with_http(runs, tmp_path):
    output = _invoke("compare", str(runs["grpc"] / "bench.json"), str(runs["http"] / "bench.json"),
                     "--json-out", str(tmp_path / "cmp.json"))
    assert "B/A" in output and "TTFT p50" in output
    ratios = {m["metric"]: m["ratio"] for m in json.loads((tmp_path / "cmp.json").read_text())["metrics"]}
    assert ratios["SLO attainment"] is not None or ratios["request throughput /s"] is not None


def test_session_run(cluster, tmp_path):
    _invoke("--target", cluster.gateway_grpc, "--sessions", "hotpotqa", "--length-scale", "0.02",
            "--num-sessions", "3", "--tool-delay", "exponential:mean=0.2", "--arrival", "poisson:rate=10",
            "--per-request", "--no-progress", "--out-dir", str(tmp_path))
    record = json.loads((tmp_path / "bench.json").read_text())
    summary = record["summary"]
    # HotpotQA has exactly 3 rounds per session.
    assert summary["n_requests"] == 9 and summary["n_ok"] == 9
    assert summary["ttft_initial"]["count"] == 3 and summary["ttft_incremental"]["count"] == 6
    by_session: dict[str, list[dict]] = {}
    for r in record["requests"]:
        by_session.setdefault(r["session_id"], []).append(r)
    assert len(by_session) == 3
    for rounds in by_session.values():
        rounds.sort(key=lambda r: r["round_index"])
        assert [r["round_index"] for r in rounds] == [0, 1, 2]
        # Each round's prompt holds the previous prompt and output, then new tokens.
        for prev, cur in zip(rounds, rounds[1:]):
            assert cur["prompt_len"] > prev["prompt_len"] + prev["output_len"]
            assert cur["arrival_s"] >= prev["end_s"]


@pytest.mark.parametrize("scheme", ["", "grpc://"])
def test_bench_against_a_closed_port_fails_at_once(scheme):
    """Nothing listening: an error naming the target within seconds, not 300 failed requests."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "splitserve.cli", "bench", "--target", f"{scheme}127.0.0.1:{port}",
                           "-n", "300", "--no-progress"], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output
    assert f"--target 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}" in output
    # The interpreter and CLI imports take a few seconds on a busy machine; the check itself <= 2 s.
    assert elapsed < 20, elapsed


def test_bench_refuses_an_unknown_target_scheme_naming_the_accepted_forms():
    result = CliRunner().invoke(bench_app, ["--target", "ftp://127.0.0.1:7000", "--no-progress"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "unknown scheme 'ftp://'" in output and "grpc://host:port" in output and "http://host[:port][/v1]" in output
