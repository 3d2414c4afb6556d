"""The scheduler's cluster view: built from Redis in the background, read without I/O.

`ClusterViewSource` is the I/O edge that refreshes the pure `build_cluster_view` and
`InflightCounters` (services.global_scheduler.cluster_view) from the StateStore every
`refresh_s`, so Place never waits on Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable

from services.global_scheduler.cluster_view import InflightCounters, build_cluster_view
from services.global_scheduler.policy import (ClusterView, NoWorkerAvailable, Placement, PlacementPolicy,
                                             PlacementRequest, WorkerSignals, orient_kv_transfers,
                                             place_diffusion)
from splitserve.service import cancel_and_wait
from splitserve.errors import Unavailable
from splitserve.state.store import DIFFUSION, StateStore, WorkerActivity, WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


class ClusterViewSource:
    """Keeps a ClusterView fresh from Redis in a background task; `current()` does no I/O.

    Idle: when nobody has read the view (a placement, ClusterState, a readiness check, the
    pool controller) for `idle_after_s`, it is re-read every `idle_refresh_s` instead of every
    `refresh_s` — a scheduler whose coordinators place locally then costs one Redis read a
    second, not twenty. The next reader gets the view at hand (at most `idle_refresh_s` old;
    Place never waits on Redis) and wakes the loop, which is back at `refresh_s` at once; a
    placement that fits nowhere re-reads first, so a worker that registered meanwhile is found."""

    def __init__(
        self,
        store: StateStore,
        refresh_s: float = 0.05,
        *,
        idle_refresh_s: float = 0.0,
        idle_after_s: float = 2.0,
        stale_after_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.store = store
        self.refresh_s = refresh_s
        # Past this age (Redis unreachable) placing on the old view is a guess about dead
        # workers; answer UNAVAILABLE instead so callers retry.
        self.stale_after_s = max(5.0, 10 * refresh_s) if stale_after_s is None else stale_after_s
        # 0 (or anything not above refresh_s): never idle.
        self.idle_refresh_s = max(refresh_s, idle_refresh_s)
        if self.idle_refresh_s > self.stale_after_s / 2:  # margin for slow reads before staleness
            raise ValueError(f"idle_refresh_s must be at most half the view's staleness limit "
                             f"({self.stale_after_s:g} s), got {idle_refresh_s}")
        self.idle_after_s = idle_after_s
        self._used_monotonic = time.monotonic()
        self._wake = asyncio.Event()
        self.reads = 0  # Redis reads of the view so far (tests)
        self.clock = clock
        self.inflight = InflightCounters()
        self._workers: list[WorkerInfo] = []
        self._loads: dict[str, WorkerLoad] = {}
        # Windowed TTFT/ITL and prefill queues, read only while the policy asks for them
        # (`view_signals`, AMPD): one more pipelined Redis read per refresh.
        self.with_signals = False
        self._signals: dict[str, WorkerSignals] = {}
        self._taken_at = 0.0
        self._refreshed_monotonic: float | None = None
        self._view: ClusterView | None = None  # cache, rebuilt after a refresh or placement
        self._loaded = asyncio.Event()
        self._refreshing: asyncio.Future[None] | None = None  # one Redis read shared by concurrent callers
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Load the first snapshot (errors propagate), then refresh in the background."""
        await self.refresh()
        self._stopping = False
        self._task = asyncio.create_task(self._refresh_loop(), name="cluster-view-refresh")

    async def stop(self) -> None:
        """Stop the background refresh."""
        self._stopping = True  # the flag as well as the cancel (see cancel_and_wait)
        await cancel_and_wait(self._task)
        self._task = None

    async def refresh(self) -> None:
        """Re-read the worker registry and load snapshots from Redis (concurrent calls share one read)."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._read())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if self._refreshing is refreshing and refreshing.done():
                self._refreshing = None

    async def _read(self) -> None:
        workers = await self.store.list_workers()
        loads = await self.store.get_loads()
        signals: dict[str, WorkerSignals] = {}
        if self.with_signals:
            activity = await self.store.worker_activity([w.worker_id for w in workers])
            signals = {worker_id: worker_signals(a) for worker_id, a in activity.items()}
        self._workers, self._loads, self._signals = workers, loads, signals
        self.reads += 1
        self._taken_at = self.clock()
        self._refreshed_monotonic = time.monotonic()
        self.inflight.observe_snapshots(loads)
        self._view = None
        self._loaded.set()

    async def current(self, timeout_s: float = 2.0) -> ClusterView:
        """The latest view; waits up to timeout_s for the first one; Unavailable if stale."""
        if self.idle:
            self._wake.set()  # back to refresh_s from now; this reader gets the view at hand
        self._used_monotonic = time.monotonic()
        if not self._loaded.is_set():
            try:
                await asyncio.wait_for(self._loaded.wait(), timeout_s)
            except asyncio.TimeoutError:
                raise Unavailable(f"cluster view not loaded from Redis within {timeout_s:.1f} s") from None
        assert self._refreshed_monotonic is not None
        age = time.monotonic() - self._refreshed_monotonic
        if age > self.stale_after_s:
            raise Unavailable(f"cluster view is {age:.1f} s old (Redis unreachable?)")
        if self._view is None:
            self._view = build_cluster_view(self._workers, self._loads, self._taken_at, self.inflight.counts(),
                                            self._signals)
        return self._view

    async def place(self, policy: PlacementPolicy, request: PlacementRequest, now: Callable[[], float],
                    timeout_s: float = 2.0) -> Placement:
        """`policy.place` on the current view and note the placement; NoWorkerAvailable if none fits.

        When no worker fits, Redis is read once more and the policy asked again: a worker
        that registered since the last background refresh (right after start-up, or a
        scale-up) is used at once instead of failing the request. There is no await
        between reading a view and noting the placement, so concurrent callers each see
        the placements made before them.
        """
        if getattr(policy, "view_signals", False) and not self.with_signals:
            self.with_signals = True  # a policy that reads them was just set: read them now
            await self.refresh()
        view = self._view_for(request, await self.current(timeout_s))
        try:
            placement = _place(policy, request, view, now)
        except NoWorkerAvailable:
            await self.refresh()
            view = self._view_for(request, await self.current(timeout_s))
            placement = _place(policy, request, view, now)
        self.note_placed(placement.worker_ids)
        return orient_kv_transfers(placement, view)

    @staticmethod
    def _view_for(request: PlacementRequest, view: ClusterView) -> ClusterView:
        """The workers that may take the request: of its engine family, none it failed on."""
        return view.without(request.avoid_workers).of_family(request.engine_family)

    def note_placed(self, worker_ids: Iterable[str]) -> None:
        """Record a placement so the next view shows it before the workers' loads do."""
        self.inflight.note_placed(worker_ids)
        self._view = None

    @property
    def idle(self) -> bool:
        """Not read for `idle_after_s`: the view is re-read every `idle_refresh_s`."""
        return (self.idle_refresh_s > self.refresh_s
                and time.monotonic() - self._used_monotonic >= self.idle_after_s)

    async def _refresh_loop(self) -> None:
        failing = False
        while not self._stopping:
            started = time.monotonic()
            try:
                await self.refresh()
                if failing:
                    log.info("cluster view refresh recovered")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:  # keep the last view and retry: one bad read must not kill the loop
                if not failing:
                    log.exception("cluster view refresh failed; keeping the previous view")
                failing = True
            if self._stopping:
                break
            interval = self.idle_refresh_s if self.idle else self.refresh_s
            self._wake.clear()
            try:  # a placement ends an idle wait at once
                await asyncio.wait_for(self._wake.wait(), max(0.0, interval - (time.monotonic() - started)))
            except asyncio.TimeoutError:
                pass


def worker_signals(activity: WorkerActivity) -> WorkerSignals:
    """The policy's view of a worker's activity: window means (None without samples) and queue."""
    return WorkerSignals(activity.ttft.mean if activity.ttft.count else None,
                         activity.itl.mean if activity.itl.count else None, activity.prefill_queue)


def _place(policy: PlacementPolicy, request: PlacementRequest, view: ClusterView,
           now: Callable[[], float]) -> Placement:
    """A diffusion request is placed whole on a diffusion worker whatever the policy (its
    split, disaggregation and session binding concern autoregressive decoding); any other
    request by the policy."""
    if request.engine_family == DIFFUSION:
        return place_diffusion(request, view)
    return policy.place(request, view, now())
