"""`splitserve up` restarts a service that dies instead of stopping the cluster (issue 18).

A worker process is killed with SIGKILL: the cluster keeps serving on the other worker, the
dead one is started again (same id and address), registers, takes requests again, and
`splitserve status` shows the restart. Only SIGTERM stops the cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from real_model_support import splitserve_up, until, wait_for_workers

from splitserve.client import Client


def _worker_pid(prefix: str, worker_id: str) -> int | None:
    """The pid of the worker process of this cluster (its command line names the prefix and id)."""
    out = subprocess.run(["pgrep", "-f", "--", f"{prefix} .*--worker-id {worker_id} "],
                         capture_output=True, text=True).stdout.split()
    mine = [int(p) for p in out if int(p) != os.getpid()]
    return mine[0] if mine else None


def test_a_killed_worker_is_restarted_and_the_cluster_keeps_serving(tiny_model_dirs, tmp_path):
    with splitserve_up(tiny_model_dirs["llama"], tmp_path, "--workers", "2", "--kv-cache-memory-bytes",
                       str(16 << 20)) as up:
        wait_for_workers(up["prefix"], 2)
        # /health is ready once one worker is; `up` supervises once every service it started is up.
        until(lambda: "serving;" in (up["log_dir"] / "up.out").read_text(), 60, "splitserve up to finish starting")
        with Client(up["grpc"], timeout_s=60) as sdk:
            before = sdk.generate("steady", max_tokens=6, temperature=0, ignore_eos=True).token_ids
            victim = until(lambda: _worker_pid(up["prefix"], "worker-1"), 10, "worker-1's pid")
            os.kill(victim, signal.SIGKILL)
            # The other worker keeps serving while worker-1 is down (retriable errors are retried
            # by the SDK; a request on the dead worker migrates).
            for _ in range(3):
                assert sdk.generate("steady", max_tokens=6, temperature=0, ignore_eos=True).token_ids == before
            restarted = until(lambda: (pid := _worker_pid(up["prefix"], "worker-1")) and pid != victim and pid,
                               30, "worker-1 to be started again")
            wait_for_workers(up["prefix"], 2, timeout_s=60)
            status = until(lambda: _status_row(up["prefix"], "worker-1"), 60, "the restart in splitserve status")
            assert status.replace("│", " ").split()[-1] == "1", status
            for _ in range(4):
                assert sdk.generate("steady", max_tokens=6, temperature=0, ignore_eos=True).token_ids == before
        assert restarted != victim
        output = (up["log_dir"] / "up.out").read_text()
        assert "worker-1 exited with code -9; restarting" in output and "worker-1 restarted (restart 1)" in output
        assert "stopping the cluster" not in output


def _status_row(prefix: str, worker_id: str) -> str | None:
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "status", "--redis-url",
                          os.environ["SPLITSERVE_TEST_REDIS_URL"], "--redis-prefix", prefix],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"}).stdout
    row = next((line for line in out.splitlines() if worker_id in line), None)
    return row if row and row.replace("│", " ").split()[-1] == "1" else None
