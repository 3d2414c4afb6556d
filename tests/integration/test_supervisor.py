"""`splitserve up` supervises: a service that dies is started again with backoff (real processes)."""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from splitserve.cli.launcher import Child, Cluster, ClusterSpec, RestartPolicy
from splitserve.redis_server import redis_reachable, start_private_redis


def test_backoff_doubles_in_a_crash_loop_and_resets_after_a_stable_run():
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, stable_after_s=60.0)
    assert [policy.backoff_s(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.backoff_s(10_000) == 4.0
    assert policy.in_a_row(0, ran_s=5.0) == 1  # the first crash
    assert policy.in_a_row(3, ran_s=5.0) == 4  # died soon again: one more in a row
    assert policy.in_a_row(3, ran_s=61.0) == 1  # ran long enough: a fresh count


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
        assert [(e.child.name, e.message) for e in events] == [("worker-1", "exited with code 3; restarting in 0.5 s")]
        assert cluster.supervise(policy, now + 0.25) == []  # not due yet
        events = cluster.supervise(policy, now + 0.5)
        assert [(e.child.name, e.message) for e in events] == [("worker-1", "restarted (restart 1)")]
        assert crashing.process.pid != first_pid and crashing.restarts == 1
        crashing.process.wait(timeout=10)  # it crashes again at once: the wait doubles
        later = time.monotonic()
        (event,) = cluster.supervise(policy, later)
        assert event.message == "exited with code 3; restarting in 1.0 s"
        assert steady.process.poll() is None and steady.restarts == 0
        assert (tmp_path / "worker-1.log").exists()
    finally:
        for child in (crashing, steady):
            if child.process.poll() is None:
                child.process.kill()
            child.process.wait(timeout=10)


# Three crashes in a row before: after a stable run the wait starts over, after a short one it doubles on.
@pytest.mark.parametrize("ran_s, waited", [(61.0, 0.5), (1.0, 0.5 * 2 ** 3)])
def test_a_crash_after_a_stable_run_restarts_at_the_initial_backoff(tmp_path, ran_s, waited):
    child = _child(tmp_path, "coordinator", "import sys; sys.exit(1)")
    child.in_a_row = 3
    child.process.wait(timeout=10)
    child.started_at = time.monotonic() - ran_s
    cluster = Cluster(ClusterSpec(model="m"), "redis://x", "p:", [child], None, "", "", [], "", "")
    (event,) = cluster.supervise(RestartPolicy(initial_backoff_s=0.5, max_backoff_s=60.0), time.monotonic())
    assert (event.kind, event.message) == ("exited", f"exited with code 1; restarting in {waited:.1f} s")


def test_a_child_that_cannot_be_started_is_tried_again_after_the_backoff(tmp_path):
    child = _child(tmp_path, "scheduler", "import sys; sys.exit(1)")
    child.process.wait(timeout=10)
    child.cmd = [str(tmp_path / "no-such-interpreter")]
    cluster = Cluster(ClusterSpec(model="m"), "redis://x", "p:", [child], None, "", "", [], "", "")
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=60.0)
    now = time.monotonic()
    (exited,) = cluster.supervise(policy, now)
    (failed,) = cluster.supervise(policy, now + 0.5)
    assert (exited.kind, failed.kind) == ("exited", "start_failed")
    assert failed.message.endswith("retrying in 1.0 s") and child.restarts == 0
    assert cluster.supervise(policy, now + 1.0) == []  # the next try is due at now + 1.5


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_private_redis_that_dies_is_restarted_on_its_port_and_stopped_with_the_cluster(tmp_path):
    private = start_private_redis()
    cluster = Cluster(ClusterSpec(model="m"), private.url, "p:", [], private, "", "", [], "", "")
    cluster.redis_child = Child("redis", private.process, private.url, None, cmd=private.argv)
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=1.0)
    try:
        assert [c.name for c in cluster.supervised()] == ["redis"]
        first = private.process
        first.kill()
        first.wait(timeout=10)
        assert not redis_reachable(private.url)
        now = time.monotonic()
        (exited,) = cluster.supervise(policy, now)
        (restarted,) = cluster.supervise(policy, now + 0.1)
        assert (exited.kind, restarted.kind) == ("exited", "restarted")
        assert private.process is cluster.redis_child.process and private.process.pid != first.pid
        deadline = time.monotonic() + 10
        while not redis_reachable(private.url):  # the same URL answers again
            assert time.monotonic() < deadline, "the restarted redis-server never answered"
            time.sleep(0.05)  # polling for the restarted server, bounded by the deadline
        assert cluster.redis_child.restarts == 1
    finally:
        cluster.stop()
    assert private.process.poll() is not None  # the restarted server is the one stopped


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_private_redis_restarted_by_another_process_is_left_to_it(tmp_path):
    """A chaos run (or an operator) restarted the Redis first: the supervisor's copy could not
    bind the port, so it stops supervising Redis instead of restarting it in a loop."""
    import subprocess

    private = start_private_redis()
    cluster = Cluster(ClusterSpec(model="m"), private.url, "p:", [], private, "", "", [], "", "")
    cluster.redis_child = Child("redis", private.process, private.url, None, cmd=private.argv)
    other = None
    try:
        private.process.kill()
        private.process.wait(timeout=10)
        now = time.monotonic()
        (exited,) = cluster.supervise(RestartPolicy(initial_backoff_s=0.1), now)
        other = subprocess.Popen(private.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not redis_reachable(private.url):
            assert time.monotonic() < deadline, "the other redis-server never answered"
            time.sleep(0.05)  # polling for the other server, bounded by the deadline
        (adopted,) = cluster.supervise(RestartPolicy(initial_backoff_s=0.1), now + 0.1)
        assert (exited.kind, adopted.kind) == ("exited", "adopted")
        assert cluster.redis_child is None and cluster.supervised() == []
        assert cluster.supervise(RestartPolicy(initial_backoff_s=0.1), now + 5) == []
    finally:
        cluster.stop()
        if other is not None:
            other.kill()
            other.wait(timeout=10)
