"""The faults: a seeded schedule, each fault injected and waited out until the service is back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from loadgen.runner import RunProgress
from splitserve.cli.chaos.options import COORDINATOR, POLL_S, REDIS, WORKER, ChaosError, ChaosOptions
from splitserve.cli.chaos.processes import (RedisProcess, ServiceProcess, grpc_serving, kill_service, redis_answers,
                                            redis_client, find_redis_process, find_service_processes)


# ---- faults ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    at_s: float
    kind: str  # worker | coordinator | redis


def plan_faults(options: ChaosOptions, rng: np.random.Generator) -> list[PlannedFault]:
    """The seeded schedule: each fault at a uniform time in [warmup_s, duration_s - settle_s], in order."""
    kinds = [WORKER] * options.worker_kills + [COORDINATOR] * options.coordinator_kills + \
        [REDIS] * options.redis_kills
    rng.shuffle(kinds)
    times = np.sort(rng.uniform(options.warmup_s, options.duration_s - options.settle_s, size=len(kinds)))
    return [PlannedFault(round(float(t), 3), kind) for t, kind in zip(times, kinds)]


@dataclass
class FaultRecord:
    """One fault as it happened."""

    kind: str
    planned_at_s: float
    at_s: float | None = None  # when the kill happened (None: not done)
    victim: str = ""
    pid: int | None = None
    running_on_victim: int | None = None  # a worker's running requests just before (its published load)
    requests_in_flight: int = 0  # the run's requests in flight at the kill
    recovered: bool = False
    recovered_after_s: float | None = None
    new_pid: int | None = None
    error: str | None = None  # why it was not done or did not recover


class Faults:
    """Runs the fault schedule against the cluster (blocking steps in threads)."""

    def __init__(self, options: ChaosOptions, rng: np.random.Generator, clock: Callable[[], float],
                 progress: Callable[[], RunProgress | None], log: Callable[[str], None]):
        self.options = options
        self.rng = rng
        self.clock = clock
        self.progress = progress
        self.log = log
        self.records: list[FaultRecord] = []
        self.spawned_redis: list[int] = []
        self.down: set[str] = set()  # services killed and not yet back

    async def run(self, plan: Sequence[PlannedFault]) -> None:
        """Each fault at its planned time, or as soon after as it is allowed (see `_allowed`); the
        recoveries are watched concurrently, and this returns once every killed service is back
        or timed out."""
        self.records = [FaultRecord(f.kind, f.at_s) for f in plan]
        watchers: list[asyncio.Task] = []
        try:
            for planned, record in zip(plan, self.records):
                if self.clock() < planned.at_s:
                    await asyncio.sleep(planned.at_s - self.clock())
                while not await self._allowed(record.kind) and self.clock() <= self.options.duration_s:
                    await asyncio.sleep(POLL_S)  # waiting for earlier faults to recover, bounded by the run
                if self.clock() > self.options.duration_s:
                    record.error = ("skipped: no time left in the run (earlier faults were still recovering: "
                                    + ", ".join(sorted(self.down)) + ")")
                    continue
                watcher = await self._one(record)
                if watcher is not None:
                    watchers.append(watcher)
        finally:
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _allowed(self, kind: str) -> bool:
        """Worker kills may overlap while another worker stays up (`min_live_workers`); a coordinator or
        Redis fault waits until every earlier fault recovered, and nothing is killed while they are down."""
        if any(name in self.down for name in (COORDINATOR, REDIS)):
            return False
        if kind != WORKER:
            return not self.down
        live = [s for s in await asyncio.to_thread(find_service_processes, self.options.redis_prefix)
                if s.service == WORKER and s.name not in self.down]
        return len(live) > self.options.min_live_workers

    def _watch(self, name: str, record: FaultRecord, wait: Callable[[], None]) -> asyncio.Task:
        """Mark `name` down now (before any later fault is considered) and watch its recovery."""
        self.down.add(name)

        async def watch() -> None:
            try:
                await asyncio.to_thread(wait)
            except Exception as err:  # noqa: BLE001 -- a failed recovery is the fault's result, not a crash
                record.error = f"recovery of {name} failed: {type(err).__name__}: {err}"
                self.log(record.error)
            finally:
                self.down.discard(name)

        return asyncio.create_task(watch())

    async def _one(self, record: FaultRecord) -> asyncio.Task | None:
        """Do one fault; returns the task watching the victim's recovery (None: nothing was killed)."""
        prefix = self.options.redis_prefix
        try:
            if record.kind == REDIS:
                redis_process = await asyncio.to_thread(find_redis_process, self.options.redis_url, prefix)
                record.victim, record.pid = "redis", redis_process.pid
                self._mark(record)
                os.kill(redis_process.pid, signal.SIGKILL)
                self.log(f"[{record.at_s:6.1f} s] killed redis (pid {redis_process.pid})")
                return self._watch(REDIS, record, lambda: self._restart_redis(redis_process, record))
            services = await asyncio.to_thread(find_service_processes, prefix)
            candidates = [s for s in services if s.service == record.kind]
            if not candidates:
                raise ChaosError(f"no live {record.kind} process of the cluster with prefix {prefix!r}"
                                 + (" (is the coordinator embedded in the gateway?)"
                                    if record.kind == COORDINATOR else ""))
            candidates = [s for s in candidates if s.name not in self.down]  # not one being restarted
            victim = candidates[int(self.rng.integers(0, len(candidates)))]
            record.victim, record.pid = victim.name, victim.pid
            if victim.service == WORKER:
                record.running_on_victim = await self._running_on(victim.name)
            await asyncio.to_thread(kill_service, victim, prefix)
            self._mark(record)
            self.log(f"[{record.at_s:6.1f} s] killed {victim.name} (pid {victim.pid}; "
                     f"{record.requests_in_flight} requests in flight"
                     + (f", {record.running_on_victim} running on it)" if record.running_on_victim is not None
                        else ")"))
            return self._watch(victim.name, record, lambda: self._wait_service_back(victim, record))
        except (ChaosError, OSError) as err:
            record.error = str(err)
            self.log(f"fault {record.kind}: {err}")
        return None

    def _mark(self, record: FaultRecord) -> None:
        record.at_s = round(self.clock(), 3)
        progress = self.progress()
        record.requests_in_flight = progress.in_flight if progress is not None else 0

    async def _running_on(self, worker_id: str) -> int | None:
        from splitserve.state.store import RedisRetryPolicy, StateStore

        try:
            async with StateStore(self.options.redis_url, self.options.redis_prefix,
                                  retry_policy=RedisRetryPolicy(attempts=1)) as store:
                load = (await asyncio.wait_for(store.get_loads(), 2.0)).get(worker_id)
        except Exception:  # noqa: BLE001 -- informational only (e.g. Redis itself is down)
            return None
        return load.running if load is not None else None

    def _wait_service_back(self, victim: ServiceProcess, record: FaultRecord) -> None:
        """Until a new process of the same service runs, is SERVING, and (a worker) is registered again."""
        deadline = time.monotonic() + self.options.recovery_timeout_s
        started = time.monotonic()
        while time.monotonic() < deadline:
            again = [s for s in find_service_processes(self.options.redis_prefix)
                     if s.name == victim.name and s.pid != victim.pid]
            if again and grpc_serving(again[0].port, self.options.internal_tls) and (
                    victim.service != WORKER or self._registered(victim.name)):
                record.recovered, record.new_pid = True, again[0].pid
                record.recovered_after_s = round(time.monotonic() - started, 2)
                self.log(f"[{self.clock():6.1f} s] {victim.name} is back (pid {again[0].pid}) after "
                         f"{record.recovered_after_s:.1f} s")
                return
            time.sleep(POLL_S)  # polling for the restart, bounded by the deadline
        record.error = f"{victim.name} not back within {self.options.recovery_timeout_s:g} s"
        self.log(record.error)

    def _registered(self, worker_id: str) -> bool:
        """The worker published its load again (what the scheduler's view reads); runs in a thread."""
        async def read() -> bool:
            from splitserve.state.store import RedisRetryPolicy, StateStore

            try:
                async with StateStore(self.options.redis_url, self.options.redis_prefix,
                                      retry_policy=RedisRetryPolicy(attempts=1)) as store:
                    return worker_id in await asyncio.wait_for(store.get_loads(), 2.0)
            except Exception:  # noqa: BLE001 -- not yet: Redis may be down too
                return False

        return asyncio.run(read())

    def _restart_redis(self, killed: RedisProcess, record: FaultRecord) -> None:
        started = time.monotonic()
        deadline = started + self.options.recovery_timeout_s
        if killed.supervised:
            self._wait_redis_restarted_by_up(killed, record, started, deadline)
            return
        while not _pid_gone(killed.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # the port is free once the killed process is gone, bounded by the deadline
        process = subprocess.Popen(list(killed.argv), executable=killed.executable, cwd=killed.cwd, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.spawned_redis.append(process.pid)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                record.error = f"the restarted redis-server exited with code {process.returncode}: {killed.argv}"
                self.log(record.error)
                return
            if redis_answers(self.options.redis_url):
                record.recovered, record.new_pid = True, process.pid
                record.recovered_after_s = round(time.monotonic() - started, 2)
                self.log(f"[{self.clock():6.1f} s] redis restarted by chaos (pid {process.pid}) after "
                         f"{record.recovered_after_s:.2f} s")
                return
            time.sleep(0.02)  # polling the new server, bounded by the deadline
        record.error = f"the restarted redis-server did not answer within {self.options.recovery_timeout_s:g} s"


    def _wait_redis_restarted_by_up(self, killed: RedisProcess, record: FaultRecord, started: float,
                                    deadline: float) -> None:
        """`splitserve up` restarts the private Redis it started: wait for another process to answer."""
        while time.monotonic() < deadline:
            pid = _redis_pid(self.options.redis_url)
            if pid is not None and pid != killed.pid:
                record.recovered, record.new_pid = True, pid
                record.recovered_after_s = round(time.monotonic() - started, 2)
                self.log(f"[{self.clock():6.1f} s] redis restarted by splitserve up (pid {pid}) after "
                         f"{record.recovered_after_s:.2f} s")
                return
            time.sleep(0.02)  # polling for the supervisor's restart, bounded by the deadline
        record.error = f"splitserve up did not restart redis within {self.options.recovery_timeout_s:g} s"
        self.log(record.error)


def _redis_pid(url: str) -> int | None:
    """The process id of the Redis answering at `url` (None: nothing answers)."""
    import redis

    client = redis_client(url)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")
