"""The Worker gRPC service: runs stages on an engine and publishes its load to Redis."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

from prometheus_client import Gauge

from splitserve.config import WorkerConfig, default_worker_id, load_config
from splitserve.errors import Conflict, FailedPrecondition, InvalidArgument, SplitserveError, abort
from splitserve.proto import types_pb2, worker_pb2, worker_pb2_grpc
from splitserve.service import ServiceRuntime, open_channel, run
from splitserve.core import InvalidInput, KvCapacityError, takes_option
from splitserve.core.designs import resolve_design
from splitserve.core.policy import FCFS, scheduling_policy_option
from splitserve.core.records import DIFFUSION, engine_family
from splitserve.state.store import (POOLS, ROLES, RedisRetryPolicy, StateStore, StateUnavailableError, WorkerInfo,
                              WorkerLoad)
from splitserve.telemetry import incoming_context, request_id_var
from splitserve.wire import load_to_proto, service_error
from workers.engine import Engine, EngineConfig
from workers.engine.config import resolve_block_size
from workers.engine_loop import EngineLoop
from workers.kv_stages import KvStageManager
from workers.kv_transfer.base import KvMemory, KvTransferError
from workers.kv_transfer.grpc_transport import GrpcTransport
from workers.kv_transfer.tracker import TransferTracker
from workers.stage_call import StageCall
from workers.vllm_metrics import WORKER_METRICS, engine_prefix_counts, served_model_name

log = logging.getLogger(__name__)

BACKENDS = ("real", "emulated")

KV_USED = Gauge("splitserve_worker_kv_blocks_used", "KV blocks in use")
LENGTH_BOUNDARY = Gauge("splitserve_worker_length_boundary_tokens",
                        "LAPS L_m(0) by the laps batch policy, refitted online (0: none, -1: never compute-bound)")
BUSY = Gauge("splitserve_worker_busy_fraction", "Share of the last publish interval the engine spent stepping")
RUNNING = Gauge("splitserve_worker_running", "Requests running")
WAITING = Gauge("splitserve_worker_waiting", "Requests waiting")
# Session histories pinned between rounds (AMPD binding); the last four only grow.
PINNED_SESSIONS = Gauge("splitserve_worker_pinned_sessions", "Sessions whose history KV is pinned here")
PINNED_BLOCKS = Gauge("splitserve_worker_pinned_kv_blocks", "KV blocks held by pinned session histories")
SESSION_EVENTS = Gauge("splitserve_worker_session_history_events",
                       "Session rounds and pins since start: hit (history found pinned), lost (expected but gone: "
                       "recomputed), evicted (memory pressure), expired (idle TTL)", ["event"])


def dialable_host(host: str) -> str:
    """The address peers dial for a server bound to `host`: a wildcard (0.0.0.0, ::, "") is
    nothing another host can dial, so this host's own address stands for it (the name's
    address, as a container or pod sees itself); any other host as given."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import socket

    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):  # e.g. Debian's 127.0.1.1 for the host name: the outward interface instead
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(("10.255.255.255", 1))  # a UDP connect picks a route; nothing is sent
                address = probe.getsockname()[0]
        except OSError:
            pass  # no route at all: only this host can dial it anyway
    return address


def resolve_num_threads(num_threads: int) -> int:
    """0 (auto): every core this process may use but one, which stays free for the gRPC event loop."""
    if num_threads > 0:
        return num_threads
    return max(1, len(os.sched_getaffinity(0)) - 1)


def batch_policy_of(config: WorkerConfig) -> str:
    """The local batch policy: `--batch-policy`, else the `--design`'s (DynaServe: slo_aware, ...), else fcfs."""
    return resolve_design(batch_policy=config.batch_policy, design=config.design).batch_policy


def batch_policy_options_from(config: WorkerConfig) -> dict:
    """The batch policy's options: `--batch-policy-options` (a JSON object), plus `--itl-slo-ms`
    as `itl_slo_ms` for a policy that takes it and `--scheduling-policy` (the scheduler reads it
    from the policy); ValueError naming the flag."""
    options: dict = {}
    batch_policy = batch_policy_of(config)
    if config.batch_policy_options.strip():
        try:
            options = json.loads(config.batch_policy_options)
        except json.JSONDecodeError as err:
            raise ValueError(f"batch_policy_options: not JSON: {err}") from None
        if not isinstance(options, dict):
            raise ValueError(f"batch_policy_options must be a JSON object, got {config.batch_policy_options!r}")
    if config.itl_slo_ms:
        if config.itl_slo_ms < 0:
            raise ValueError(f"itl_slo_ms must be >= 0, got {config.itl_slo_ms}")
        if not takes_option(batch_policy, "itl_slo_ms"):
            raise ValueError(f"itl_slo_ms: batch policy {batch_policy!r} takes no ITL objective")
        if "itl_slo_ms" in options:
            raise ValueError("itl_slo_ms is given twice: as --itl-slo-ms and in --batch-policy-options")
        options["itl_slo_ms"] = config.itl_slo_ms
    if scheduling_policy_option(config.scheduling_policy) != FCFS:
        if "scheduling_policy" in options:
            raise ValueError("scheduling_policy is given twice: as --scheduling-policy and in --batch-policy-options")
        options["scheduling_policy"] = config.scheduling_policy
    return options


def engine_config_from(config: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        model=config.model, dtype=config.dtype, device=config.device,
        block_size=resolve_block_size(config.block_size, config.device, config.attention_backend,
                                      real_engine=config.backend == "real"),
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len or None, kv_cache_memory_bytes=config.kv_cache_memory_bytes or None,
        gpu_memory_utilization=config.gpu_memory_utilization, enable_prefix_caching=config.enable_prefix_caching,
        batch_policy=batch_policy_of(config), batch_policy_options=batch_policy_options_from(config),
        perf_model=config.perf_model, num_threads=resolve_num_threads(config.num_threads), detokenize=False,
        attention_backend=config.attention_backend, cpu_linear=config.cpu_linear,
        captured_shapes=config.captured_shapes, shape_tokens=config.shape_tokens, shape_batches=config.shape_batches,
        captured_shapes_executor=config.captured_shapes_executor, max_captured_buckets=config.max_captured_buckets,
        decode_graphs=config.decode_graphs, decode_graph_batches=config.decode_graph_batches,
        structured_output_cache_size=config.structured_output_cache_size,
        dllm_cache=config.dllm_cache, max_num_logits=config.max_num_logits, sparse_kv=config.sparse_kv,
        diffusion_policy=config.diffusion_policy, static_batch_size=config.static_batch_size,
    )


@dataclass
class _LatencySamples:
    ttft: list[float]
    itl: list[float]


def _flip_a_payload_byte(chunk) -> None:
    if chunk.payload:
        middle = len(chunk.payload) // 2
        chunk.payload = chunk.payload[:middle] + bytes([chunk.payload[middle] ^ 0x5A]) + chunk.payload[middle + 1:]


def _NO_KV_HERE(worker_id: str) -> FailedPrecondition:  # noqa: N802 (reads as the error it builds)
    return FailedPrecondition(f"worker {worker_id} serves a diffusion model: it holds no KV to move")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """gRPC face of one engine."""

    def __init__(self, server: "WorkerServer"):
        self.server = server

    async def Execute(self, stage: types_pb2.Stage, context):
        request_id_var.set(stage.request_id)
        # Under the coordinator's stage span, whose W3C context arrives in the call's metadata.
        call = StageCall(self.server, stage, incoming_context(context.invocation_metadata()))
        try:
            await call.start()
        except SplitserveError as err:
            await abort(context, err)
            return
        # Closed with this call, so that a caller that leaves aborts the stage at once.
        async with contextlib.aclosing(call.stream()) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Cancel(self, request: types_pb2.CancelRequest, context):
        loop = self.server.loop
        # Stages in flight and finished ones still holding KV (keep_kv) alike.
        keys = set(await loop.call(lambda engine: engine.stage_keys(request.request_id)))
        keys |= {key for key in loop.stage_keys() if key.request_id == request.request_id}
        for key in sorted(keys):
            loop.abort(key)
        released = 0 if self.server.kv is None else await self.server.kv.release_for_request(request.request_id)
        return types_pb2.CancelResponse(cancelled=bool(keys) or released > 0)

    async def ReleaseSession(self, request: worker_pb2.ReleaseSessionRequest, context):
        if not request.session_id:
            await abort(context, InvalidArgument("session_id is required", param="session_id"))
        session_id = request.session_id
        released = await self.server.loop.call(lambda engine: engine.release_session(session_id))
        return worker_pb2.ReleaseSessionResponse(released=released)

    async def GetLoad(self, request, context):
        return self.server.load_proto()

    async def SetRole(self, request: worker_pb2.SetRoleRequest, context):
        srv = self.server
        if request.role not in ROLES:
            await abort(context, InvalidArgument(f"role must be one of {ROLES}, got {request.role!r}", param="role"))
        if request.pool not in POOLS:
            await abort(context, InvalidArgument(f"pool must be one of {POOLS}, got {request.pool!r}", param="pool"))
        if request.fencing_token and request.fencing_token < srv.role_fence:
            # A deposed pool controller (its leader lock lapsed and another took it) must not
            # undo its successor's moves.
            await abort(context, Conflict(f"fencing_token {request.fencing_token} is stale: this worker has seen "
                                          f"{srv.role_fence}", param="fencing_token"))
        srv.role_fence = max(srv.role_fence, request.fencing_token)
        previous, previous_pool = srv.role, srv.pool
        # Nothing queued or running here is touched: a role or pool only steers where new
        # work is placed, from the next load snapshot on (published at once below).
        srv.role, srv.pool = request.role, request.pool
        await srv.register()
        await srv.publish_load()
        log.info("role changed %s/%s -> %s/%s", previous, previous_pool or "-", request.role, request.pool or "-")
        return worker_pb2.SetRoleResponse(previous_role=previous, role=request.role, previous_pool=previous_pool,
                                          pool=request.pool)

    async def Drain(self, request: worker_pb2.DrainRequest, context):
        timeout = request.deadline_ms / 1000 if request.deadline_ms else None
        in_flight = await self.server.drain(timeout)
        return worker_pb2.DrainResponse(in_flight=in_flight)

    async def PrepareKv(self, request: worker_pb2.PrepareKvRequest, context):
        # A request id too: a reservation is freed by Cancel(request_id), or only at its TTL.
        for name in ("request_id", "transfer_id", "num_tokens"):
            if not getattr(request, name):
                await abort(context, InvalidArgument(f"{name} is required (request_id, transfer_id and num_tokens > 0)",
                                                     param=name))
        if self.server.draining:
            return worker_pb2.PrepareKvResponse(ok=False, error=f"worker {self.server.worker_id} is draining")
        if self.server.kv is None:
            return worker_pb2.PrepareKvResponse(ok=False, error=f"worker {self.server.worker_id} serves a diffusion "
                                                "model: it takes no KV")
        try:
            blocks = await self.server.kv.prepare(request.request_id, request.transfer_id, request.num_tokens,
                                                  request.start, wait_s=request.wait_ms / 1000)
        except KvCapacityError as err:
            return worker_pb2.PrepareKvResponse(ok=False, error=str(err))
        except InvalidInput as err:
            await abort(context, service_error(err))
        return worker_pb2.PrepareKvResponse(ok=True, block_ids=blocks)

    async def LeaseSessionKv(self, request: worker_pb2.LeaseSessionKvRequest, context):
        if not request.session_id or not request.request_id:
            await abort(context, InvalidArgument("session_id and request_id are required", param="session_id"))
        if self.server.draining or self.server.kv is None:  # the prefill worker then recomputes the history
            return worker_pb2.LeaseSessionKvResponse()
        blocks, tokens = await self.server.kv.lease_session(request.request_id, request.session_id,
                                                            request.max_tokens)
        return worker_pb2.LeaseSessionKvResponse(block_ids=blocks, num_tokens=tokens)

    async def PullKv(self, request, context):
        if self.server.grpc_kv is None:
            await abort(context, _NO_KV_HERE(self.server.worker_id))
        num_blocks = self.server.grpc_kv.memory.num_blocks
        if not request.block_ids or any(not 0 <= b < num_blocks for b in request.block_ids):
            await abort(context, InvalidArgument(f"block_ids: pull {request.transfer_id}: {len(request.block_ids)} "
                                                 f"block ids, valid range [0, {num_blocks})", param="block_ids"))
        try:
            async for chunk in self.server.grpc_kv.handle_pull(request):
                yield chunk
        except KvTransferError as err:  # the blocks are this worker's (above): a bad token range
            await abort(context, InvalidArgument(f"start: {err}", param="start"))

    async def PushKv(self, request_iterator, context):
        if self.server.grpc_kv is None:
            await abort(context, _NO_KV_HERE(self.server.worker_id))
        return await self.server.grpc_kv.handle_push(request_iterator)

    async def Profile(self, request, context):
        from workers.profiling import handle_profile  # real engine steps of synthetic shapes

        if self.server.kv is None:
            await abort(context, FailedPrecondition(f"worker {self.server.worker_id} serves a diffusion model; "
                                                    "profiling measures autoregressive prefill and decode steps"))
        try:
            return await handle_profile(self.server, request)
        except ValueError as err:
            await abort(context, InvalidArgument(str(err)))


class WorkerServer:
    """A worker process's parts: engine thread, gRPC server, Redis publisher."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.runtime = ServiceRuntime("worker", config, config.port)
        self.store = StateStore(
            config.redis_url, config.redis_prefix,
            retry_policy=RedisRetryPolicy(attempts=max(1, config.redis_connect_attempts)),
            heartbeat_ttl_s=config.heartbeat_ttl_s, latency_window_s=config.latency_window_s,
        )
        self.role = config.role
        self.pool = config.prefill_pool
        self.role_fence = 0  # highest pool-controller fencing token seen (SetRole)
        self.draining = False
        self._busy_mark = (time.monotonic(), 0.0)  # (when, engine busy seconds then): busy_fraction's interval
        self._busy_fraction = 0.0
        self.samples = _LatencySamples([], [])
        self.worker_id = config.worker_id
        self.address = ""
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.kv: KvStageManager | None = None
        self.grpc_kv: GrpcTransport | None = None
        self._tasks: list[asyncio.Task] = []
        # redis-py can swallow a cancellation that lands mid-command; loops also check this.
        self._stopping = False

    async def start(self) -> None:
        """Connect Redis, load the engine, listen, register; raises on any failure."""
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.pool not in POOLS:
            raise ValueError(f"prefill_pool must be one of {POOLS}, got {self.pool!r}")
        if self.config.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.config.backend!r}")
        if self.config.backend == "real" and not self.config.model:
            raise ValueError("model: a model directory is required (--model or SPLITSERVE_WORKER_MODEL)")
        await self.store.connect()
        self.engine = await asyncio.to_thread(self._build_engine)
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop(), thread_init=self._engine_thread_init())
        self.loop.start()
        served = self.config.served_model_name  # the gateway's name for the model
        WORKER_METRICS.attach(served_model_name(self.config.model, self.config.model_preset, served),
                              lambda: self.loop.snapshot.load, engine_prefix_counts(self.engine))
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(self), self.runtime.server)
        await self.runtime.start()
        port = self.runtime.bound_port
        self.worker_id = self.worker_id or default_worker_id(self.config.host, port)
        self.address = self.config.advertise_address or f"{dialable_host(self.config.host)}:{port}"
        if engine_family(self.engine.engine_kind) != DIFFUSION:  # a diffusion request never moves KV
            await self._start_kv_transfer()
        await self.register()
        await self.publish_load()
        self._tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._publish_loop())]
        await self.runtime.set_serving(True)
        log.info("worker %s serving %s at %s (role %s, local batching %s, scheduling %s)", self.worker_id,
                 self.config.model, self.address, self.role, batch_policy_of(self.config), self.config.scheduling_policy)

    def _engine_thread_init(self):
        """On CPU, give torch's intra-op pool the thread count on the engine thread itself."""
        if self.config.backend != "real":
            return None
        threads = resolve_num_threads(self.config.num_threads)

        def init() -> None:
            import torch

            if self.engine.device.type == "cpu":
                torch.set_num_threads(threads)
        return init

    def _build_engine(self) -> Engine:
        """The engine of `backend`: the real one (the diffusion engine for a diffusion model), or
        the emulated one (no weights, perf-model timing)."""
        cfg = engine_config_from(self.config)
        if self.config.backend == "real":
            from workers.diffusion.engine import DiffusionEngine, is_diffusion_model  # torch: real engines only

            if is_diffusion_model(self.config.model):
                return DiffusionEngine(cfg)
        if self.config.backend == "emulated":
            from workers.engine.emulated import Emulation, build_emulated_engine

            return build_emulated_engine(cfg, Emulation(
                self.config.gpu, self.config.model_preset, self.config.tp, perf_model_path=self.config.perf_model,
                perf_backend=self.config.perf_backend, perf_framework=self.config.perf_framework,
                perf_database_version=self.config.perf_database_version))
        return Engine(cfg)

    async def _start_kv_transfer(self) -> None:
        """KV memory, transfer tracker and transport: NIXL when importable (or asked for), else gRPC.

        Emulated: block accounting without bytes; pushes and pulls sleep the perf model's
        transfer time and carry metadata only over Worker.PushKv / PullKv."""
        cfg = self.config
        emulated = cfg.backend == "emulated"
        if emulated:
            from workers.kv_transfer.emulated_transport import EmulatedKvMemory, EmulatedTransport

            memory = EmulatedKvMemory(self.engine.num_kv_blocks, self.engine.config.block_size)  # resolved
        else:
            memory = KvMemory(self.engine.kv_cache)
        self.kv = KvStageManager(self.worker_id, self.loop, memory, TransferTracker(), cfg.kv_transfer_timeout_s,
                                 cfg.kv_reservation_ttl_s, cfg.kv_fault_injection, layer_push=cfg.kv_layer_push)
        # The gRPC transport always serves PushKv/PullKv (peers may use it); it is also the fallback.
        if emulated:
            self.grpc_kv = EmulatedTransport(self.worker_id, memory, self.store, self.kv.on_chunk,
                                             self.engine.perf_model)
        else:
            self.grpc_kv = GrpcTransport(self.worker_id, memory, self.store, self.kv.on_chunk)
        # Peers are dialed as every service dials another: mutual TLS when configured.
        self.grpc_kv.channel_factory = lambda address, options: open_channel(address, cfg, options)
        transport = self.grpc_kv
        if not emulated and cfg.kv_transport in ("auto", "nixl"):
            try:
                from workers.kv_transfer.nixl_transport import NixlTransport

                transport = NixlTransport(self.worker_id, memory, self.store, self.kv.on_chunk,
                                          lanes=cfg.kv_transfer_lanes)
            except ImportError as err:
                if cfg.kv_transport == "nixl":
                    raise ValueError(f"kv_transport=nixl but nixl is not importable: {err}") from None
                log.info("nixl not importable (%s); KV moves over gRPC", err)
        elif cfg.kv_transport not in ("auto", "nixl", "grpc"):
            raise ValueError(f"kv_transport must be auto, nixl or grpc, got {cfg.kv_transport!r}")
        try:
            await transport.start()
        except Exception as err:
            if cfg.kv_transport == "nixl":
                raise
            log.warning("NIXL failed to start (%s); KV moves over gRPC", err)
            transport = self.grpc_kv
            await transport.start()
        self.kv.transport = transport
        if not emulated:
            self.kv.failure_notice = self.grpc_kv.signal_failure  # over gRPC whatever carries the data
            if cfg.kv_fault_injection == "corrupt":
                # Testing: the bytes themselves are altered in flight, after their digest was
                # taken: on gRPC a payload byte flipped, on NIXL each WRITE reads the wrong
                # source blocks (a misaddressed DMA); the receiver's check must catch both.
                self.grpc_kv.outgoing_chunk_hook = _flip_a_payload_byte
                self.grpc_kv.corrupt_writes = True
                transport.corrupt_writes = True
        log.info("KV transport: %s", transport.name)

    async def register(self) -> None:
        await self.store.register_worker(WorkerInfo(
            worker_id=self.worker_id, address=self.address, role=self.role,
            engine_kind=self.engine.engine_kind, model=self.config.model,
        ))

    def load_snapshot(self) -> WorkerLoad:
        """The engine's latest load figures with this worker's identity, role and draining flag."""
        snapshot = self.loop.snapshot
        return dataclasses.replace(snapshot.load, worker_id=self.worker_id, role=self.role, draining=self.draining,
                                   updated_unix=snapshot.taken_at, pool=self.pool,
                                   busy_fraction=self._busy_fraction)

    def load_proto(self) -> types_pb2.WorkerLoad:
        return load_to_proto(self.load_snapshot())

    async def publish_load(self) -> None:
        now, busy = time.monotonic(), self.loop.busy_s
        since, busy_then = self._busy_mark
        if now - since >= 0.05:  # a SetRole right after a periodic publish keeps the last figure
            self._busy_fraction = min(1.0, max(0.0, (busy - busy_then) / (now - since)))
            self._busy_mark = (now, busy)
        snap = self.load_snapshot()
        LENGTH_BOUNDARY.set(snap.length_boundary)
        BUSY.set(snap.busy_fraction)
        KV_USED.set(snap.total_blocks - snap.free_blocks)
        RUNNING.set(snap.running)
        WAITING.set(snap.waiting)
        sessions = self.loop.snapshot.sessions
        PINNED_SESSIONS.set(sessions.pinned_sessions)
        PINNED_BLOCKS.set(sessions.pinned_blocks)
        for event, value in (("hit", sessions.history_hits), ("lost", sessions.history_lost),
                             ("evicted", sessions.evictions), ("expired", sessions.expirations)):
            SESSION_EVENTS.labels(event).set(value)
        await self.store.publish_load(snap)
        await self.store.publish_prefill_queue(self.worker_id, self.loop.snapshot.prefill_queue)
        ttft, itl = self.samples.ttft, self.samples.itl
        self.samples = _LatencySamples([], [])
        now = time.time()
        # Bounded per interval: the window statistics need a sample, not every token. One
        # round trip for all of them, so a burst does not stall token delivery on this loop.
        await self.store.record_latencies(self.worker_id, ttft[-64:], itl[-64:], now)

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.heartbeat_interval_s)  # periodic schedule, not synchronisation
            if self.kv is not None:
                # Reservations nobody claimed (their coordinator died) are freed at their TTL even
                # when no new reservation arrives to trigger the reaping.
                self.kv.reap_expired()
            try:
                if not await self.store.heartbeat(self.worker_id):
                    await self.register()  # expired (e.g. Redis restarted): come back
                    publish = getattr(self.kv.transport, "publish", None) if self.kv is not None else None
                    if publish is not None:  # NIXL: peers find our agents again
                        await publish()
            except Exception as err:
                log.warning("heartbeat failed: %s", err)

    async def _publish_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.load_interval_s)
            try:
                await self.publish_load()
            except Exception as err:
                log.warning("publishing load failed: %s", err)

    async def drain(self, timeout_s: float | None) -> int:
        """Stop admitting stages; wait until in-flight ones finish or the timeout passes."""
        self.draining = True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.loop.num_in_flight and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)  # polling the engine's in-flight count, bounded by the deadline
        return self.loop.num_in_flight

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        try:
            await self.store.deregister_worker(self.worker_id)
        except Exception as err:
            log.warning("deregistering failed: %s", err)
        if self.kv is not None and self.kv.transport is not None:
            try:
                await self.kv.transport.close()
                if self.kv.transport is not self.grpc_kv:
                    await self.grpc_kv.close()
            except Exception as err:
                log.warning("closing the KV transport failed: %s", err)
        WORKER_METRICS.detach()
        if self.loop is not None:
            self.loop.stop()
        await self.runtime.server.stop(grace=1.0)
        await self.store.close()


async def serve(config: WorkerConfig) -> None:
    """Run a worker until SIGTERM; exits non-zero with a clear message when it cannot start."""
    server = WorkerServer(config)
    try:
        await server.start()
    except StateUnavailableError as err:
        log.error("cannot reach Redis: %s", err)
        sys.exit(2)
    except (ValueError, FileNotFoundError) as err:
        log.error("invalid worker configuration: %s", err)
        sys.exit(2)
    await server.runtime.serve_until_signalled(drain=lambda: server.drain(config.drain_timeout_s))
    await server.stop()


def main(config: WorkerConfig | None = None) -> None:
    run(lambda: serve(config or load_config(WorkerConfig)))


if __name__ == "__main__":
    main()
