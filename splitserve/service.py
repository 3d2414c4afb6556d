"""Process runtime shared by the gRPC services: server, health, metrics, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.config import CommonConfig
from splitserve.tls import TlsConfigError, channel_credentials, open_aio_channel, server_credentials
from splitserve.telemetry import setup_logging, setup_tracing, shutdown_tracing, start_metrics_server

log = logging.getLogger(__name__)

# gRPC health service names: "" and the proto service's own name report readiness (this
# replica can serve a request now); LIVENESS_SERVICE that the process answers at all.
LIVENESS_SERVICE = "liveness"
MTLS_FIELDS = ("mtls_ca_file", "mtls_cert_file", "mtls_key_file")
# ServiceRuntime's `server_credentials` default: the internal mTLS of the config (or plaintext).
INTERNAL = object()


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has ended. A loop that talks to Redis
    should also check a stop flag: redis-py can swallow a cancellation that lands mid-command."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def grpc_options(config: CommonConfig) -> list[tuple[str, int]]:
    """Channel/server options: message size limits and keepalive suited to long streams."""
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A restarted peer (supervised, seconds away) is dialled again within 0.2-2 s instead of
        # gRPC's default 1 s growing by 1.6x, which added 2-3 s to every restart's recovery.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def mtls_enabled(config: CommonConfig) -> bool:
    """Whether the services talk mutual TLS (`--mtls-ca-file` set)."""
    return bool(config.mtls_ca_file)


def check_mtls(config: CommonConfig) -> None:
    """Refuse a half-configured mTLS (ValueError naming the option): a CA without this service's
    certificate and key, or a certificate without the CA."""
    if config.mtls_ca_file:
        for name in ("mtls_cert_file", "mtls_key_file"):
            if not getattr(config, name):
                raise TlsConfigError(name, "is required with --mtls-ca-file (mutual TLS: each service presents "
                                           "its own certificate)")
    elif config.mtls_cert_file or config.mtls_key_file or config.mtls_server_name:
        raise TlsConfigError("mtls_ca_file", "is required with --mtls-cert-file / --mtls-key-file / "
                                             "--mtls-server-name (the CA the peers' certificates are checked "
                                             "against; without it the services talk plaintext)")


@functools.lru_cache(maxsize=8)
def _mtls_channel_credentials(ca_file: str, cert_file: str, key_file: str) -> grpc.ChannelCredentials:
    return channel_credentials(ca_file, cert_file, key_file, fields=MTLS_FIELDS)


def internal_channel_credentials(config: CommonConfig) -> grpc.ChannelCredentials | None:
    """Credentials of a channel to another service: mTLS when configured, else None (plaintext)."""
    check_mtls(config)
    if not mtls_enabled(config):
        return None
    return _mtls_channel_credentials(config.mtls_ca_file, config.mtls_cert_file, config.mtls_key_file)


def internal_server_credentials(config: CommonConfig) -> grpc.ServerCredentials | None:
    """Credentials of a service's own gRPC server: with mTLS every client must present a
    certificate signed by the CA; None: plaintext."""
    check_mtls(config)
    if not mtls_enabled(config):
        return None
    return server_credentials(config.mtls_cert_file, config.mtls_key_file, config.mtls_ca_file,
                              fields=(MTLS_FIELDS[1], MTLS_FIELDS[2], MTLS_FIELDS[0]))


def open_channel(address: str, config: CommonConfig,
                 options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    """The channel from one service to another: mutual TLS when `--mtls-ca-file` is set, else
    plaintext. Every internal gRPC client (gateway -> coordinator -> scheduler, coordinator ->
    worker, worker -> worker KV, pool control) dials through here."""
    return open_aio_channel(address, internal_channel_credentials(config),
                            grpc_options(config) if options is None else options, config.mtls_server_name)


def channel_factory(config: CommonConfig,
                    options: list[tuple[str, int]] | None = None) -> Callable[[str], grpc.aio.Channel]:
    """`open_channel` bound to `config`: for components that dial peers found at run time."""
    return functools.partial(open_channel, config=config, options=options)


# The name before mTLS existed; it now means `open_channel` (secure when configured).
insecure_channel = open_channel


class ServiceRuntime:
    """One service process: gRPC server with health, Prometheus, tracing and graceful drain."""

    def __init__(self, service: str, config: CommonConfig, port: int, grpc_service: str = "",
                 server_credentials: grpc.ServerCredentials | None | object = INTERNAL):
        """`server_credentials`: by default the services' mTLS (`--mtls-*`, plaintext when unset);
        the gateway passes its public listener's TLS (or None: plaintext) instead."""
        self.service = service
        # The proto service name health clients ask about, e.g. "splitserve.v1.Worker".
        self.grpc_service = grpc_service or f"splitserve.v1.{service.capitalize()}"
        self.config = config
        self.port = port
        setup_logging(service, config.log_level, config.log_json)
        setup_tracing(service, config.otlp_endpoint)
        # Before the server exists: a bad TLS option stops the start naming the option.
        self.credentials = internal_server_credentials(config) if server_credentials is INTERNAL else server_credentials
        self.server = grpc.aio.server(options=grpc_options(config))
        self.health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.bound_port = 0
        self.metrics_port = 0
        self._stop = asyncio.Event()

    async def start(self) -> None:
        # grpc_health reports "" as SERVING by default; readiness is ours to declare. Liveness
        # ("liveness") is SERVING while the server runs, starting and draining included.
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        address = f"{self.config.host}:{self.port}"
        if self.credentials is None:
            self.bound_port = self.server.add_insecure_port(address)
        else:
            self.bound_port = self.server.add_secure_port(address, self.credentials)
        if self.bound_port == 0:
            raise RuntimeError(f"{self.service}: cannot listen on {self.config.host}:{self.port}")
        await self.server.start()
        self.metrics_port = start_metrics_server(self.config.host, self.config.metrics_port)
        log.info("%s listening on %s:%d%s (metrics on :%d)", self.service, self.config.host, self.bound_port,
                 "" if self.credentials is None else " over TLS", self.metrics_port)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(self.grpc_service, status)

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_until_signalled(self, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM/SIGINT, then stop admitting, drain, and stop the server."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):
                pass  # not the main thread (tests): request_stop() still works
        await self._stop.wait()
        log.info("%s draining (timeout %.0f s)", self.service, self.config.drain_timeout_s)
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), self.config.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s drain timed out; stopping with work in flight", self.service)
        await self.server.stop(grace=2.0)
        log.info("%s stopped", self.service)


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's main coroutine on uvloop; a failed start exits with code 2, not a traceback."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(main())
        shutdown_tracing()  # the last spans reach the collector before the process ends
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except Exception as err:  # e.g. a port already taken
        log.error("fatal: %s", err, exc_info=True)
        code = 2
    else:
        return
    # Leave at once: tearing down half-started grpc.aio objects after their loop closed
    # can crash the interpreter during garbage collection.
    logging.shutdown()
    os._exit(code)
