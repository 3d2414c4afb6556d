"""The scheduler's LAPS pool-controller loop: one leader in the cluster, moves by Worker.SetRole.

Every scheduler replica running the `laps` policy runs this loop; each control period it
tries to take (or renew) the Redis leader lock `pool-controller` and only the holder acts:
it runs one step of the pure `PoolController` (Alg. 2) on the scheduler's cluster view
and sends the changes as `Worker.SetRole(role="prefill", pool=..., fencing_token=...)`.
The token is the lock's fencing token, which grows with every new holder; a worker refuses
a token below the highest it has seen, so a controller that lost the lock (paused past its
TTL, then woke) cannot undo its successor's moves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc

from services.global_scheduler import metrics
from services.global_scheduler.pool_controller import LONG, SHORT, PoolController, PoolDecision, PoolMove
from services.global_scheduler.view import ClusterViewSource
from splitserve.proto import worker_pb2, worker_pb2_grpc
from splitserve.service import cancel_and_wait
from splitserve.state.store import StateStore, StateUnavailableError

log = logging.getLogger(__name__)

LOCK_NAME = "pool-controller"
SetRole = Callable[[str, PoolMove, int], Awaitable[None]]  # (address, change, fencing token)


class PoolControlLoop:
    """Runs `controller` every period while this replica holds the leader lock."""

    def __init__(self, views: ClusterViewSource, store: StateStore, controller: PoolController, holder: str, *,
                 clock: Callable[[], float] = time.time, set_role: SetRole | None = None,
                 rpc_timeout_s: float = 2.0, channel_factory: Callable[[str], grpc.aio.Channel] | None = None):
        """`channel_factory(address)` dials a worker (the service's `open_channel`: mTLS when
        configured); default plaintext."""
        self.views = views
        self.store = store
        self.controller = controller
        self.holder = holder
        self.clock = clock
        self.rpc_timeout_s = rpc_timeout_s
        self._set_role = set_role or self._set_role_over_grpc
        self._open_channel = channel_factory or grpc.aio.insecure_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.decisions: list[PoolDecision] = []  # the last few, for status and tests
        self.leader = False

    @property
    def period_s(self) -> float:
        return self.controller.config.period_s

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name="pool-controller")

    async def stop(self) -> None:
        self._stopping = True  # the flag as well as the cancel (see cancel_and_wait)
        await cancel_and_wait(self._task)
        self._task = None
        if self.leader:
            try:
                await self.store.release_leader(LOCK_NAME, self.holder)
            except StateUnavailableError:
                pass  # it lapses by its TTL
            self.leader = False
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed period (Redis blip, a worker gone) must not end control
                log.exception("pool controller period failed")
            await asyncio.sleep(self.period_s)

    async def tick(self) -> PoolDecision | None:
        """One control period; the decision, or None when another replica leads."""
        # The lock outlives a few missed periods, so a slow period does not hand it over.
        token = await self.store.try_acquire_leader(LOCK_NAME, self.holder, ttl_s=max(3 * self.period_s, 2.0))
        self.leader = token is not None
        self.fencing_token = token or 0
        metrics.POOL_CONTROL_LEADER.set(1 if self.leader else 0)
        if token is None:
            return None
        view = await self.views.current()
        decision = self.controller.step(view, self.clock())
        applied = []
        for change in decision.changes:
            worker = view.get(change.worker_id)
            try:
                if worker is None:
                    raise LookupError("the worker left the cluster view")
                await self._set_role(worker.address, change, token)
            except (grpc.aio.AioRpcError, LookupError) as err:
                # The next period sees the pool as it is and decides again.
                reason = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
                log.warning("SetRole %s -> %s failed: %s", change.worker_id, change.to_pool, reason)
                if change is decision.move:
                    self.controller.move_failed()
                continue
            applied.append(change)
            if change is decision.move:
                metrics.POOL_MOVES.labels(change.to_pool).inc()
                log.info("pool controller moved %s from %s to %s (P_s %.3f, P_l %.3f)", change.worker_id,
                         change.from_pool, change.to_pool, decision.short_pressure, decision.long_pressure)
        pools = [w.load.pool for w in view.by_role("prefill")]
        for change in applied:
            pools.append(change.to_pool)
            pools.remove(change.from_pool)
        for pool, pressure in ((SHORT, decision.short_pressure), (LONG, decision.long_pressure)):
            metrics.POOL_PRESSURE.labels(pool).set(pressure)
            metrics.POOL_SIZE.labels(pool).set(pools.count(pool))
        self.decisions = [*self.decisions[-63:], decision]
        return decision

    async def _set_role_over_grpc(self, address: str, change: PoolMove, token: int) -> None:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._open_channel(address)
        await worker_pb2_grpc.WorkerStub(channel).SetRole(
            worker_pb2.SetRoleRequest(role="prefill", pool=change.to_pool, fencing_token=token),
            timeout=self.rpc_timeout_s)
