"""The placement policy's view of the simulated cluster: stale snapshots plus inflight counters.

The real scheduler places on a `ClusterView` rebuilt from load snapshots the workers
publish periodically, and counts its own placements since each snapshot
(`InflightCounters`). Here every worker's load is snapshotted at the refresh instants
`k * refresh_s` of virtual time (`SimWorker.load_at`), and the view is built by the
scheduler's own `build_cluster_view` and `InflightCounters`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from services.global_scheduler.policy import ClusterView, WorkerSignals, WorkerView
from services.global_scheduler.cluster_view import InflightCounters, build_cluster_view
from services.planner.sim_worker import SimWorker, published
from splitserve.core.records import WorkerInfo

__all__ = ["SimClusterView", "ENGINE_KIND"]

ENGINE_KIND = "simulated"


class SimClusterView:
    """Builds the ClusterView a policy sees at a virtual time, as `ClusterViewSource` would."""

    def __init__(self, workers: Sequence[SimWorker], refresh_s: float, with_signals: bool = False):
        if not refresh_s > 0:
            raise ValueError(f"view_refresh_s must be > 0, got {refresh_s}")
        self.workers = list(workers)
        self.refresh_s = refresh_s
        # Windowed TTFT/ITL and prefill queues for a policy that reads them (AMPD), as the
        # scheduler reads them from Redis; the workers keep the windows (`signals_window_s`).
        self.with_signals = with_signals
        self.inflight = InflightCounters()
        self._tick = -1
        self._view: ClusterView | None = None
        self._position: dict[str, int] = {}
        self.num_refreshes = 0

    def current(self, now: float) -> ClusterView:
        """The view as of the latest refresh instant, with placements counted since then."""
        tick = int(now / self.refresh_s)
        if tick != self._tick or self._view is None:
            self._refresh(tick)
        assert self._view is not None
        return self._view

    def note_placed(self, worker_ids: Iterable[str]) -> None:
        """Count a placement on each stage's worker, so the next placement sees it before the loads do."""
        worker_ids = list(worker_ids)
        self.inflight.note_placed(worker_ids)
        if self._view is None:
            return
        counts = self.inflight.counts()
        views = list(self._view.workers)
        for worker_id in set(worker_ids):
            index = self._position.get(worker_id)
            if index is not None:
                view = views[index]
                views[index] = WorkerView(view.worker_id, view.address, view.load, counts.get(worker_id, 0),
                                          view.signals)
        self._view = ClusterView(tuple(views), self._view.taken_at)

    def _refresh(self, tick: int) -> None:
        taken_at = tick * self.refresh_s
        infos, loads = [], {}
        for w in self.workers:
            # The registry holds the role a worker started with; the snapshot its live role.
            infos.append(WorkerInfo(w.worker_id, f"sim://{w.worker_id}", role=w.role, engine_kind=ENGINE_KIND,
                                    started_unix=0.0))
            loads[w.worker_id] = published(w, w.load_at(tick), ENGINE_KIND, taken_at)
        self.inflight.observe_snapshots(loads)
        signals = None
        if self.with_signals:
            signals = {}
            for w in self.workers:
                ttft, itl, queue = w.signals(taken_at)
                signals[w.worker_id] = WorkerSignals(ttft, itl, tuple(queue))
        self._view = build_cluster_view(infos, loads, taken_at, self.inflight.counts(), signals)
        self._position = {v.worker_id: i for i, v in enumerate(self._view.workers)}
        self._tick = tick
        self.num_refreshes += 1
