"""The gateway process: gRPC Gateway (with health) and the OpenAI HTTP API on one event loop.

In-process (tests): `async with running_gateway(config) as gw: gw.grpc_port, gw.http_port`
(ports 0 pick free ones), or `await serve(config, ready=callback)` which calls
`callback(server)` once both listeners are up. As a process: `python -m gateway.server`
with `SPLITSERVE_GATEWAY_*` / `SPLITSERVE_*` environment variables; it logs
"gateway ready: grpc port N, http port M" when it accepts requests.

TLS: with `--tls-cert-file` / `--tls-key-file` both public listeners (gRPC and HTTP) speak
TLS, and with `--tls-client-ca-file` they require a client certificate signed by that CA. The
gateway's channel to the coordinator follows the services' `--mtls-*` options, as every
internal channel does (splitserve/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
from typing import AsyncIterator, Callable

import grpc

import uvicorn

from gateway.coordinator_client import CoordinatorClient, EmbeddedCoordinatorClient
from gateway.core import GatewayCore
from gateway.grpc_api import GatewayServicer
from gateway.http_api import create_app
from gateway.rate_limit import KeyRateLimiter
from gateway.tokenization import Tokenization
from services.coordinator.server import open_coordinator
from splitserve.config import CommonConfig, CoordinatorConfig, GatewayConfig, load_config
from splitserve.proto import gateway_pb2_grpc
from splitserve.state.store import RedisRetryPolicy, StateStore
from splitserve.keys import load_keys_file
from splitserve.service import ServiceRuntime, cancel_and_wait, open_channel, run
from splitserve.tls import TlsConfigError, read_pem, server_credentials

log = logging.getLogger(__name__)

HTTP_SHUTDOWN_GRACE_S = 2.0
READINESS_INTERVAL_S = 0.5  # how often gRPC health re-checks readiness (and a check's timeout)
# GatewayConfig.coordinator_address value that runs the coordinator in the gateway process.
EMBEDDED = "embedded"


class _UvicornWithoutSignals(uvicorn.Server):
    """uvicorn that leaves signals alone: the ServiceRuntime owns SIGTERM and the drain."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def embedded_coordinator_config(config: GatewayConfig) -> CoordinatorConfig:
    """SPLITSERVE_COORDINATOR_* from the environment; options common to all services from the gateway's own."""
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(CommonConfig) if f.metadata.get("common")}
    return load_config(CoordinatorConfig, shared)


PUBLIC_TLS_FIELDS = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")


def public_grpc_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """The public gRPC listener's TLS (None: plaintext); TlsConfigError naming the option."""
    if not (config.tls_cert_file or config.tls_key_file):
        if config.tls_client_ca_file:
            raise TlsConfigError("tls_cert_file", "is required with --tls-client-ca-file (client certificates are "
                                                  "asked for only over TLS)")
        return None
    return server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file,
                              fields=PUBLIC_TLS_FIELDS)


def public_http_ssl_options(config: GatewayConfig) -> dict[str, object]:
    """uvicorn's ssl_* options for the HTTP listener ({} : plaintext). The files are checked
    first so that a bad one is refused naming its option, not by an SSL error."""
    if public_grpc_credentials(config) is None:  # validates the same options
        return {}
    read_pem(config.tls_cert_file, "tls_cert_file")
    read_pem(config.tls_key_file, "tls_key_file", private_key=True)
    options: dict[str, object] = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
    if config.tls_client_ca_file:
        options.update(ssl_ca_certs=config.tls_client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    try:  # the same check uvicorn makes at start, where its error would name no option
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except ssl.SSLError as err:
        raise TlsConfigError("tls_key_file", f"does not match --tls-cert-file or cannot be loaded: "
                                             f"{err.reason or err}") from None
    return options


class GatewayServer:
    """One gateway: gRPC Gateway + health on `config.port`, HTTP on `config.http_port`, one coordinator channel."""

    def __init__(self, config: GatewayConfig, tokenization: Tokenization | None = None,
                 coordinator_config: CoordinatorConfig | None = None):
        if tokenization is None and not config.model:
            raise ValueError("the gateway needs a model directory (SPLITSERVE_GATEWAY_MODEL / --model) for its "
                             "tokenizer and max length")
        self.config = config
        self._tokenization = tokenization
        # Its ports are public: the gateway's own TLS (or plaintext), not the services' mTLS.
        # Checked before anything starts: a bad option stops the start naming it.
        self._http_ssl = public_http_ssl_options(config)
        self.runtime = ServiceRuntime("gateway", config, config.port, server_credentials=public_grpc_credentials(config))
        self.core: GatewayCore | None = None
        self.http_port = 0
        self._http: _UvicornWithoutSignals | None = None
        self._http_task: asyncio.Task | None = None
        # coordinator_address "embedded": the Coordinator runs here (config from the
        # SPLITSERVE_COORDINATOR_* environment unless given) and closes with the gateway.
        self._coordinator_config = coordinator_config
        self._embedded = None
        self._exit_stack = contextlib.AsyncExitStack()
        self._readiness_task: asyncio.Task | None = None

    @property
    def grpc_port(self) -> int:
        return self.runtime.bound_port

    async def start(self) -> None:
        """Load the tokenizer, open the coordinator channel, start both listeners, report SERVING."""
        config = self.config
        tokenization = self._tokenization or await asyncio.to_thread(Tokenization.from_model_dir, config.model)
        if config.coordinator_address == EMBEDDED:
            coordinator_config = self._coordinator_config or embedded_coordinator_config(config)
            embedded = await self._exit_stack.enter_async_context(open_coordinator(coordinator_config))
            self._embedded = embedded
            coordinator = EmbeddedCoordinatorClient(embedded, tokenization)
        else:
            coordinator = CoordinatorClient(open_channel(config.coordinator_address, config), tokenization)
        tenants = await asyncio.to_thread(load_keys_file, config.api_keys_file) if config.api_keys_file else []
        tenant_limits = any(t.limits.requests_per_minute is not None or t.limits.tokens_per_minute is not None
                            for t in tenants)
        limiter = None
        if config.rate_limit_requests_per_minute or config.rate_limit_tokens_per_minute or tenant_limits:
            limiter = KeyRateLimiter(self._rate_limit_store(), config.rate_limit_requests_per_minute,
                                     config.rate_limit_tokens_per_minute, tenant_limits=tenant_limits)
        self.core = GatewayCore(config, tokenization, coordinator, limiter, tenants=tenants)
        if self.core.keys.enabled:
            log.info("API keys required: %d tenant(s) from the keys file%s", len(tenants),
                     ", plus the --api-keys keys (tenant 'default')" if self.core.keys.plain_keys else "")
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(self.core), self.runtime.server)
        await self.runtime.start()
        sock = _listen(config.host, config.http_port)
        self.http_port = sock.getsockname()[1]
        self._http = _UvicornWithoutSignals(uvicorn.Config(
            create_app(self.core), log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE_S, **self._http_ssl))
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # raises the startup error
                raise RuntimeError("the HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        # gRPC health follows readiness (as /health does): SERVING once a request would be served.
        await self._update_readiness()
        self._readiness_task = asyncio.create_task(self._readiness_loop())
        log.info("gateway ready: grpc port %d, http port %d%s, model %s, coordinator %s", self.grpc_port,
                 self.http_port, "" if not self._http_ssl else (
                     " (TLS, client certificates required)" if config.tls_client_ca_file else " (TLS)"),
                 self.core.model_name, config.coordinator_address)

    def _rate_limit_store(self) -> StateStore:
        """The Redis the per-key buckets live in (connected on first use; a request is let
        through while it does not answer, see gateway/rate_limit.py)."""
        store = StateStore(self.config.redis_url, self.config.redis_prefix,
                           retry_policy=RedisRetryPolicy(attempts=1))
        self._exit_stack.push_async_callback(store.close)
        return store

    async def _update_readiness(self) -> bool:
        ready, _ = await self.core.ready(timeout_s=READINESS_INTERVAL_S)
        await self.runtime.set_serving(ready)
        return ready

    async def _readiness_loop(self) -> None:
        while self.core.admission.admitting:
            try:
                await self._update_readiness()
            except Exception as err:  # a probe reports; it must not end the loop
                log.warning("readiness check failed: %s", err)
            await asyncio.sleep(READINESS_INTERVAL_S)  # periodic re-check, not synchronisation

    async def drain(self) -> None:
        """Stop admitting (new requests get UNAVAILABLE / 503) and wait for in-flight ones."""
        assert self.core is not None
        await cancel_and_wait(self._readiness_task)
        await self.runtime.set_serving(False)
        self.core.admission.stop_admitting()
        await self.core.admission.wait_idle()
        if self._embedded is not None:
            await self._embedded.drain()

    async def serve_until_signalled(self) -> None:
        """Serve until SIGTERM/SIGINT (or request_stop), drain, then stop everything."""
        try:
            await self.runtime.serve_until_signalled(self.drain)
        finally:
            await self._close_http_and_channel()

    def request_stop(self) -> None:
        """Begin the same drain-and-stop as SIGTERM (for in-process use)."""
        self.runtime.request_stop()

    async def shutdown(self) -> None:
        """Drain (bounded by drain_timeout_s) and stop, without touching signal handlers."""
        await self.runtime.set_serving(False)
        if self.core is not None:
            try:
                await asyncio.wait_for(self.drain(), self.config.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("gateway drain timed out; stopping with work in flight")
        await self.runtime.server.stop(grace=2.0)
        await self._close_http_and_channel()

    async def _close_http_and_channel(self) -> None:
        await cancel_and_wait(self._readiness_task)
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await asyncio.gather(self._http_task, return_exceptions=True)
        if self.core is not None:
            await self.core.coordinator.close()
        await self._exit_stack.aclose()


async def serve(config: GatewayConfig, ready: Callable[[GatewayServer], object] | None = None) -> None:
    """Run a gateway until SIGTERM/SIGINT or `server.request_stop()`; `ready(server)` is called once it is up."""
    server = GatewayServer(config)
    try:
        await server.start()
    except BaseException:
        await server.shutdown()
        raise
    if ready is not None:
        ready(server)
    await server.serve_until_signalled()


@contextlib.asynccontextmanager
async def running_gateway(config: GatewayConfig,
                          tokenization: Tokenization | None = None) -> AsyncIterator[GatewayServer]:
    """Start a gateway in this event loop for the `async with` body, then drain and stop it."""
    server = GatewayServer(config, tokenization)
    try:
        await server.start()
        yield server
    finally:
        await server.shutdown()


def main(config: GatewayConfig | None = None) -> None:
    """Process entry point: config from the environment unless given."""
    config = config or load_config(GatewayConfig)
    run(lambda: serve(config))


if __name__ == "__main__":
    main()
