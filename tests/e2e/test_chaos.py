"""`splitserve chaos` (issue 18): workers of a `splitserve up` cluster killed with SIGKILL on a
seeded schedule while requests with known outputs run; nothing may be lost or corrupted.

The cluster: 3 workers on a tiny random Llama; the chaos run: 45 s of Poisson traffic (6
requests/s) over 12 cases (greedy and sampled with a fixed seed), each case's output taken once
on the quiet cluster first, and 2 worker kills in its first 20 s (the second while the first
victim may still be restarting: a worker restart takes 5-60 s on a busy 2-core machine, so kills
that wait for one another would not fit a short run). Every request must complete (retries
allowed) with exactly its case's output, every killed worker must come back and `splitserve up`
must count its restart.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import typer
from real_model_support import splitserve_up, until, wait_for_workers
from typer.testing import CliRunner

from splitserve.cli.chaos import ChaosOptions, chaos_command, parse_service_cmdline, plan_faults


def _chaos_app() -> typer.Typer:
    # The command as splitserve/cli.py registers it (`app.command("chaos")(chaos_command)`).
    app = typer.Typer()
    app.command("chaos")(chaos_command)
    return app


# Extended tier (make test-all): tests/e2e/test_migration_under_kills.py[split] covers killed
# workers with exact streams in the default suite.
@pytest.mark.slow
def test_killed_workers_lose_no_request_and_corrupt_no_output(tiny_model_dirs, tmp_path):
    with splitserve_up(tiny_model_dirs["llama"], tmp_path, "--workers", "3", "--kv-cache-memory-bytes",
                       str(16 << 20)) as up:
        wait_for_workers(up["prefix"], 3)
        # `up` supervises (restarts what dies) once every service it started is up.
        until(lambda: "serving;" in (up["log_dir"] / "up.out").read_text(), 120, "splitserve up to finish starting")
        out = tmp_path / "chaos.json"
        result = CliRunner().invoke(_chaos_app(), [
            "--target", up["grpc"], "--redis-url", os.environ["SPLITSERVE_TEST_REDIS_URL"],
            "--redis-prefix", up["prefix"], "--seed", "7", "--duration-s", "30", "--warmup-s", "3",
            "--settle-s", "15", "--worker-kills", "2", "--rate", "6", "--cases", "12", "--max-tokens", "64,160",
            "--recovery-timeout-s", "180",
            "--out", str(out)], env={"COLUMNS": "200"})
        console = (up["log_dir"] / "up.out").read_text()
    assert out.exists(), f"no report; exit {result.exit_code}:\n{result.output}\n{result.exception!r}"
    report = json.loads(out.read_text())
    summary = {k: report[k] for k in ("requests", "completed", "retried", "failed", "mismatches", "broken_streams",
                                      "attempt_errors", "problems")}
    assert report["requests"] >= 130, summary  # ~6 req/s for 30 s
    assert report["mismatches"] == 0, (summary, report["failures"])
    assert report["failed"] == 0 and report["completed"] == report["requests"], (summary, report["failures"])
    faults = report["faults"]
    assert len(faults) == 2 and all(f["kind"] == "worker" and f["at_s"] is not None for f in faults), faults
    assert all(f["recovered"] and f["new_pid"] != f["pid"] for f in faults), faults
    assert report["ok"] and result.exit_code == 0, (summary, faults, result.output)
    for victim in {f["victim"] for f in faults}:
        killed = sum(f["victim"] == victim for f in faults)
        assert report["restarts_after"].get(victim, 0) - report["restarts_before"].get(victim, 0) == killed
        assert f"{victim} exited with code -9; restarting" in console
    assert "stopping the cluster" not in console.split("stopping ...")[0]


def test_options_refuse_traffic_beyond_loopback():
    with pytest.raises(ValueError, match="loopback"):
        ChaosOptions(target="10.0.0.5:50051")
    with pytest.raises(ValueError, match="loopback"):
        ChaosOptions(redis_url="redis://redis.example:6379/0")
    with pytest.raises(ValueError, match="warmup_s"):
        ChaosOptions(duration_s=5, warmup_s=3, settle_s=3)
    ChaosOptions(target="localhost:1", redis_url="redis://[::1]:6379/0")


def test_processes_are_found_by_their_prefix_and_id():
    argv = ["/x/python", "-X", "faulthandler", "-m", "splitserve.cli", "serve", "worker", "--redis-prefix",
            "ss:a:", "--port", "123", "--worker-id", "worker-2"]
    found = parse_service_cmdline(9, argv, "ss:a:")
    assert found is not None and (found.service, found.name, found.port) == ("worker", "worker-2", 123)
    assert parse_service_cmdline(9, argv, "ss:b:") is None  # another cluster's worker
    assert parse_service_cmdline(9, argv, "ss:") is None  # a prefix of the prefix is not the prefix
    assert parse_service_cmdline(9, ["pytest", "-k", "serve", "--redis-prefix", "ss:a:"], "ss:a:") is None


def test_the_schedule_is_seeded_and_bounded():
    options = ChaosOptions(duration_s=40, warmup_s=5, settle_s=10, worker_kills=3, coordinator_kills=1,
                           redis_kills=1)
    plans = [plan_faults(options, np.random.default_rng(3)) for _ in range(2)]
    assert plans[0] == plans[1]
    assert sorted(f.kind for f in plans[0]) == ["coordinator", "redis", "worker", "worker", "worker"]
    assert all(5 <= f.at_s <= 30 for f in plans[0]) and [f.at_s for f in plans[0]] == sorted(f.at_s for f in plans[0])


def test_half_configured_mtls_is_refused_naming_the_missing_option(tmp_path):
    from splitserve.cli.chaos.command import _internal_tls

    assert _internal_tls("", "", "", "") is None
    with pytest.raises(ValueError, match="^mtls_server_name: "):
        _internal_tls("", "", "", "splitserve-internal")
    with pytest.raises(ValueError, match="^mtls_key_file: "):
        _internal_tls(str(tmp_path / "ca.pem"), str(tmp_path / "service.pem"), "", "")
    with pytest.raises(ValueError, match="^mtls_ca_file: cannot read"):
        _internal_tls(str(tmp_path / "ca.pem"), str(tmp_path / "service.pem"), str(tmp_path / "service.key"), "")
