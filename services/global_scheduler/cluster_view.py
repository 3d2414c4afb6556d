"""The pure half of the scheduler's cluster view: a `ClusterView` from the worker
registry and load snapshots, and the count of placements each snapshot does not show yet.

The scheduler service refreshes them from Redis (`services.global_scheduler.view`); the
simulator builds them from its simulated workers (`services.planner.sim_view`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from services.global_scheduler.policy import ClusterView, WorkerSignals, WorkerView
from splitserve.core.records import WorkerInfo, WorkerLoad


def build_cluster_view(
    workers: Iterable[WorkerInfo],
    loads: Mapping[str, WorkerLoad],
    taken_at: float,
    inflight: Mapping[str, int] | None = None,
    signals: Mapping[str, WorkerSignals] | None = None,
) -> ClusterView:
    """Join registry entries with load snapshots (and, when read, the workers' signals);
    workers without a snapshot are left out."""
    inflight = inflight or {}
    signals = signals or {}
    views = []
    for info in workers:
        load = loads.get(info.worker_id)
        if load is None:  # no fresh load: we cannot judge it, so we do not place on it
            continue
        # The load snapshot carries the live role (Worker.SetRole changes it); the registry
        # entry keeps the role the worker started with.
        if not (load.role and load.engine_kind):  # (a replace per worker per refresh adds up in the simulator)
            load = dataclasses.replace(load, role=load.role or info.role, engine_kind=load.engine_kind or info.engine_kind)
        views.append(WorkerView(info.worker_id, info.address, load, inflight.get(info.worker_id, 0),
                                signals.get(info.worker_id)))
    return ClusterView(tuple(views), taken_at)


class InflightCounters:
    """Requests placed per worker since that worker's last load snapshot."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._snapshot_time: dict[str, float] = {}

    def note_placed(self, worker_ids: Iterable[str]) -> None:
        """Count one placement on each worker (a multi-stage plan counts on every stage's worker)."""
        for worker_id in worker_ids:
            self._counts[worker_id] = self._counts.get(worker_id, 0) + 1

    def observe_snapshots(self, loads: Mapping[str, WorkerLoad]) -> None:
        """Reset the counter of every worker whose snapshot is new; forget vanished workers."""
        for worker_id, load in loads.items():
            if self._snapshot_time.get(worker_id) != load.updated_unix:
                self._snapshot_time[worker_id] = load.updated_unix
                self._counts.pop(worker_id, None)
        for worker_id in set(self._snapshot_time) - set(loads):
            del self._snapshot_time[worker_id]
            self._counts.pop(worker_id, None)

    def counts(self) -> dict[str, int]:
        """Current counts by worker id (workers with none are absent)."""
        return dict(self._counts)
