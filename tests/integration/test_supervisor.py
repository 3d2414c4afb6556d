"""`splitserve up` supervises: a service that dies is started again with backoff (real processes)."""

from __future__ import annotations

import sys
import time

import pytest

from splitserve.launcher import Child, Cluster, ClusterSpec, RestartPolicy


def test_backoff_doubles_in_a_crash_loop_and_resets_after_a_stable_run():
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, stable_after_s=60.0)
    assert [policy.backoff_s(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.backoff_s(10_000) == 4.0
    assert policy.in_a_row(3, ran_s=5.0) == 4  # died soon again: one more in a row
    assert policy.in_a_row(3, ran_s=61.0) == 0  # ran long enough: a fresh start


def _child(tmp_path, name: str, code: str) -> Child:
    import subprocess

    cmd = [sys.executable, "-c", code]
    log = tmp_path / f"{name}.log"
    return Child(name, subprocess.Popen(cmd), "", log, cmd=cmd)


def test_dead_children_are_restarted_when_due_and_live_ones_left_alone(tmp_path):
    crashing = _child(tmp_path, "worker-1", "import sys; sys.exit(3)")
    steady = _child(tmp_path, "gateway", "import time; time.sleep(30)")
    cluster = Cluster(ClusterSpec(model="m"), "redis://x", "p:", [crashing, steady], None, "", "", [], "", "")
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0)
    try:
        crashing.process.wait(timeout=10)
        first_pid = crashing.process.pid
        now = time.monotonic()
        events = cluster.supervise(policy, now)
        assert [(c.name, what) for c, what in events] == [("worker-1", "exited with code 3; restarting in 1.0 s")]
        assert cluster.supervise(policy, now + 0.5) == []  # not due yet
        events = cluster.supervise(policy, now + 1.0)
        assert [(c.name, what) for c, what in events] == [("worker-1", "restarted (restart 1)")]
        assert crashing.process.pid != first_pid and crashing.restarts == 1
        crashing.process.wait(timeout=10)  # it crashes again at once: the wait doubles
        later = time.monotonic()
        (event,) = cluster.supervise(policy, later)
        assert event[1] == "exited with code 3; restarting in 2.0 s"
        assert steady.process.poll() is None and steady.restarts == 0
        assert (tmp_path / "worker-1.log").exists()
    finally:
        for child in (crashing, steady):
            if child.process.poll() is None:
                child.process.kill()
            child.process.wait(timeout=10)


# Three crashes in a row before: after a stable run the wait starts over, after a short one it doubles on.
@pytest.mark.parametrize("ran_s, waited", [(61.0, 0.5), (1.0, 0.5 * 2 ** 4)])
def test_a_crash_after_a_stable_run_restarts_at_the_initial_backoff(tmp_path, ran_s, waited):
    child = _child(tmp_path, "coordinator", "import sys; sys.exit(1)")
    child.in_a_row = 3
    child.process.wait(timeout=10)
    child.started_at = time.monotonic() - ran_s
    cluster = Cluster(ClusterSpec(model="m"), "redis://x", "p:", [child], None, "", "", [], "", "")
    (event,) = cluster.supervise(RestartPolicy(initial_backoff_s=0.5, max_backoff_s=60.0), time.monotonic())
    assert event[1] == f"exited with code 1; restarting in {waited:.1f} s"
