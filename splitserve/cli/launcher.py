"""`splitserve up`: the whole cluster as local child processes, stopped together."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.core.designs import DesignChoice, resolve_design
from splitserve.core.policy import scheduling_policy_option
from splitserve.errors import InvalidArgument
from splitserve.redis_server import DEFAULT_REDIS_URL, PrivateRedis, ensure_redis, redis_reachable
from splitserve.redis_server import free_port as pick_free_port
from splitserve.tls import ClientTls, TlsConfigError


@dataclass
class ClusterSpec:
    """What to launch."""

    model: str
    workers: int = 2
    # Placement, or a design's name (dynaserve | laps | ampd), which also gives the workers the
    # design's local batch policy unless worker_args["batch_policy"] names another (an ablation).
    policy: str = "least_loaded"
    # The workers' and the gateway's scheduling policy: fcfs (nonzero priorities refused) | priority.
    scheduling_policy: str = "fcfs"
    http_port: int = 8000
    grpc_port: int = 50051
    redis_url: str = DEFAULT_REDIS_URL
    # Whether a private redis-server may stand in for `redis_url` when it does not answer; None:
    # only for DEFAULT_REDIS_URL. `splitserve up` passes False for a URL its user configured.
    redis_fallback: bool | None = None
    redis_prefix: str = ""  # default: a fresh prefix per cluster
    host: str = "127.0.0.1"
    prefill_workers: int = 0  # > 0: the first N workers get role prefill, the others decode
    worker_args: dict[str, object] = field(default_factory=dict)
    gateway_args: dict[str, object] = field(default_factory=dict)
    scheduler_args: dict[str, object] = field(default_factory=dict)
    coordinator_args: dict[str, object] = field(default_factory=dict)
    # "process": its own service (the deployment topology) | "embedded": inside the gateway
    # process (one gRPC hop less per request and per token).
    coordinator: str = "process"
    # "scheduler": plans from the GlobalScheduler service | "local": the same policy in the coordinator.
    placement: str = "scheduler"
    log_dir: Path | None = None
    log_json: bool = True
    # OTLP/gRPC endpoint every service exports its spans to ("" : none, unless the standard
    # OTEL_EXPORTER_OTLP_ENDPOINT is set in the environment the services inherit).
    otlp_endpoint: str = ""
    # Mutual TLS between the services (scripts/make_certs.py makes the files): the CA, and the
    # certificate + key every service presents (as server and client). Empty: plaintext.
    mtls_ca_file: str = ""
    mtls_cert_file: str = ""
    mtls_key_file: str = ""
    # TLS of the gateway's public gRPC and HTTP listeners; with tls_client_ca_file clients must
    # present a certificate signed by it.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    # What the launcher's own health checks of the gateway trust and present: the CA that signed
    # tls_cert_file (default: mtls_ca_file) and, when client certificates are required, a client
    # certificate signed by tls_client_ca_file (default: the services' mtls certificate).
    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""

    @property
    def design(self) -> DesignChoice:
        """The placement and local batch policy the cluster runs."""
        batch_policy = self.worker_args.get("batch_policy")
        return resolve_design(self.policy, str(batch_policy) if batch_policy else None)

    def internal_tls(self) -> ClientTls | None:
        """How a tool reaches the scheduler, coordinator and workers (None: plaintext)."""
        if not self.mtls_ca_file:
            return None
        return ClientTls(self.mtls_ca_file, self.mtls_cert_file, self.mtls_key_file)

    def gateway_tls(self) -> ClientTls | None:
        """How a client reaches the gateway's gRPC and HTTP ports (None: plaintext)."""
        if not self.tls_cert_file:
            return None
        ca = self.tls_ca_file or self.mtls_ca_file
        if not ca:
            raise TlsConfigError("tls_ca_file", "is required with tls_cert_file: the CA the launcher checks the "
                                                "gateway's certificate against")
        if not self.tls_client_ca_file:
            return ClientTls(ca)
        cert, key = self.tls_client_cert_file or self.mtls_cert_file, self.tls_client_key_file or self.mtls_key_file
        if not (cert and key):  # else every health check would be refused until the start timed out
            raise TlsConfigError("tls_client_cert_file", "is required with tls_client_ca_file (or --mtls-cert-file "
                                                         "and --mtls-key-file): the launcher's own health checks "
                                                         "must present a client certificate to the gateway")
        return ClientTls(ca, cert, key)

    @classmethod
    def from_options(cls, options: UpOptions, model_dir: Path, *, served_name: str = "",
                     note: Callable[[str], None] = lambda line: None) -> ClusterSpec:
        """`splitserve up`'s cluster from its options (the dtype already normalized) and the model
        directory it provisioned; `served_name`: the Hugging Face id the model was given by. A bad
        option raises InvalidArgument naming its flag; `note` hears the advice worth printing."""
        o = options
        if o.worker_threads < 0:
            raise InvalidArgument(f"must be >= 0, got {o.worker_threads}", param="--worker-threads")
        worker_args: dict[str, object] = {"max_num_seqs": o.max_num_seqs, "kv_transport": o.kv_transport,
                                          "backend": o.backend}
        if o.batch_policy:  # else the design's (start_cluster resolves it)
            worker_args["batch_policy"] = o.batch_policy
        if o.backend == "real":
            worker_args["num_threads"] = o.worker_threads or threads_per_worker(len(os.sched_getaffinity(0)),
                                                                                o.workers)
        if o.itl_slo_ms:  # the worker refuses an ITL objective for a policy that has no use for one
            worker_args["itl_slo_ms"] = o.itl_slo_ms
        if o.dtype != "auto":
            worker_args["dtype"] = o.dtype
        if o.backend == "emulated":
            worker_args.update(gpu=o.gpu, model_preset=o.model_preset, tp=o.tp, perf_backend=o.perf_backend)
        policy_params = key_value_options(o.policy_param, "--policy-param")
        if o.policy in ("dynaserve", "laps") and o.backend == "emulated":
            # The scheduler predicts with the times the emulated workers sleep.
            policy_params.setdefault("perf_model", f"{o.perf_backend}:{o.gpu}/{o.model_preset}/{o.tp}")
        elif o.policy == "dynaserve" and "perf_model" not in policy_params:
            note("dynaserve predicts load with the H100/llama-3-8b preset: its split points balance by that "
                 "model's shape, not this machine's; `splitserve profile` fits one (--policy-param perf_model=...)")
        if o.kv_cache_memory_bytes is not None or o.backend != "emulated":
            worker_args["kv_cache_memory_bytes"] = 256 << 20 if o.kv_cache_memory_bytes is None \
                else o.kv_cache_memory_bytes
        spec = cls(
            model=str(model_dir), workers=o.workers, policy=o.policy, http_port=o.http_port, grpc_port=o.grpc_port,
            redis_url=o.redis_url or DEFAULT_REDIS_URL, redis_fallback=not o.redis_url,  # one configured must answer
            redis_prefix=o.redis_prefix, host=o.host, log_dir=o.log_dir,
            prefill_workers=o.prefill_workers,
            worker_args=worker_args, scheduling_policy=o.scheduling_policy,
            scheduler_args={"split_ratio": o.split_ratio, "policy_params": json.dumps(policy_params)},
            gateway_args=emulated_gateway_args(o.backend, o.model_preset),
            coordinator=o.coordinator,
            placement=default_placement(o.policy) if o.placement == "auto" else o.placement,
            otlp_endpoint=o.otlp_endpoint,
            mtls_ca_file=o.mtls_ca_file, mtls_cert_file=o.mtls_cert_file, mtls_key_file=o.mtls_key_file,
            tls_cert_file=o.tls_cert_file, tls_key_file=o.tls_key_file, tls_client_ca_file=o.tls_client_ca_file,
            tls_ca_file=o.tls_ca_file,
        )
        if served_name:  # a Hugging Face id: clients send it as the model, as with vllm serve
            spec.gateway_args.setdefault("served_model_name", served_name)
            spec.worker_args.setdefault("served_model_name", served_name)  # the metrics' model_name label
        if o.api_keys_file:
            spec.gateway_args["api_keys_file"] = o.api_keys_file
        return spec


@dataclass(frozen=True)
class UpOptions:
    """`splitserve up`'s flags, typed: their defaults and help are the flags' (splitserve/cli/up.py)."""

    workers: int
    model: Path | None
    dtype: str
    demo_model: str | None
    model_cache: Path | None
    policy: str
    policy_param: list[str] | None
    batch_policy: str | None
    scheduling_policy: str
    itl_slo_ms: float
    prefill_workers: int
    split_ratio: float
    kv_transport: str
    http_port: int
    grpc_port: int
    redis_url: str | None
    redis_prefix: str
    host: str
    log_dir: Path
    demo_request: bool
    max_num_seqs: int
    worker_threads: int
    kv_cache_memory_bytes: int | None
    backend: str
    gpu: str
    model_preset: str
    tp: int
    perf_backend: str
    coordinator: str
    placement: str
    otlp_endpoint: str
    mtls_ca_file: str
    mtls_cert_file: str
    mtls_key_file: str
    tls_cert_file: str
    tls_key_file: str
    tls_client_ca_file: str
    tls_ca_file: str
    api_keys_file: str


def key_value_options(items: list[str] | None, flag: str) -> dict[str, str]:
    """Repeatable key=value options -> dict; InvalidArgument names the flag."""
    params: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InvalidArgument(f"expected key=value, got {item!r}", param=flag)
        params[key.strip()] = value.strip()
    return params


def emulated_gateway_args(backend: str, model_preset: str) -> dict[str, object]:
    """An emulated cluster's gateway accepts what its workers do: the preset model's context,
    not the small tokenizer model's max_position_embeddings."""
    if backend != "emulated":
        return {}
    from splitserve.perf.presets import model_spec

    return {"max_model_len": model_spec(model_preset).context_len}


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised service that died is started again: after `initial_backoff_s`, doubled
    per restart in a row up to `max_backoff_s`; a run that lasted `stable_after_s` resets the
    count (a crash loop backs off, a rare crash is restarted at once), as a process supervisor
    or Kubernetes' CrashLoopBackOff does."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0

    def backoff_s(self, crashes_in_a_row: int) -> float:
        """The wait before the next start after this many crashes in a row (1: a first or rare
        crash, restarted after `initial_backoff_s`)."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** min(max(0, crashes_in_a_row - 1), 32))

    def in_a_row(self, previous_in_a_row: int, ran_s: float) -> int:
        """Crashes in a row counting this one, after a run of `ran_s` seconds: a stable run
        starts the count over."""
        return 1 if ran_s >= self.stable_after_s else previous_in_a_row + 1


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    grpc_address: str
    log_path: Path | None
    metrics_port: int = 0
    cmd: list[str] = field(default_factory=list)  # how to start it again
    env: dict[str, str] | None = None
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # since the cluster started
    in_a_row: int = 0  # restarts without a stable run between them
    restart_at: float | None = None  # when a dead child is due to start again
    tls: ClientTls | None = None  # how the launcher's health checks reach it (None: plaintext)

    def respawn(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=self.env)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy
        self.started_at = time.monotonic()
        self.restarts += 1
        self.restart_at = None


@dataclass
class Cluster:
    """A running local cluster."""

    spec: ClusterSpec
    redis_url: str
    redis_prefix: str
    children: list[Child]
    private_redis: PrivateRedis | None
    gateway_grpc: str
    gateway_http: str
    worker_addresses: list[str]
    scheduler_address: str
    coordinator_address: str
    # The private Redis as a supervised child (None: the cluster uses a Redis it did not start,
    # which whoever runs it restarts). Restarted on its own port, empty: the services reconnect
    # and rebuild their records (docs/reliability.md).
    redis_child: Child | None = None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every child (gateway first, so no new work arrives), then Redis."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if self.private_redis is not None:
            self.private_redis.stop()

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.process.poll() is not None]

    def supervised(self) -> list[Child]:
        """Every process `supervise` restarts: the private Redis first (the services need it), then
        the services."""
        return ([self.redis_child] if self.redis_child is not None else []) + self.children

    def supervise(self, policy: RestartPolicy, now: float | None = None) -> list[SupervisionEvent]:
        """One supervision pass: note each newly dead child's restart time by `policy`, start the
        ones that are due (one that cannot be started is tried again after the next backoff).
        Called periodically by `splitserve up` until it is told to stop."""
        now = time.monotonic() if now is None else now
        happened = []
        for child in self.supervised():
            if child.process.poll() is None:
                continue
            if child.restart_at is None:
                child.in_a_row = policy.in_a_row(child.in_a_row, now - child.started_at)
                child.restart_at = now + policy.backoff_s(child.in_a_row)
                happened.append(SupervisionEvent(child, EXITED, f"exited with code {child.process.returncode}; "
                                                                f"restarting in {child.restart_at - now:.1f} s"))
            elif now >= child.restart_at:
                if child is self.redis_child and redis_reachable(child.grpc_address):
                    # Someone else started a Redis on its port meanwhile (an operator, a chaos
                    # run against a Redis it does not know we supervise): ours would not bind.
                    self.redis_child = None
                    happened.append(SupervisionEvent(child, ADOPTED, "answers again, restarted by another process: "
                                                                     "no longer supervised"))
                    continue
                try:
                    child.respawn()
                except OSError as err:  # e.g. the interpreter or its log file is gone for a moment
                    child.in_a_row += 1
                    child.restart_at = now + policy.backoff_s(child.in_a_row)
                    happened.append(SupervisionEvent(child, START_FAILED, f"could not be started ({err}); "
                                                                          f"retrying in {child.restart_at - now:.1f} s"))
                    continue
                if child is self.redis_child and self.private_redis is not None:
                    self.private_redis.process = child.process  # what `stop` terminates
                happened.append(SupervisionEvent(child, RESTARTED, f"restarted (restart {child.restarts})"))
        return happened


EXITED, RESTARTED, START_FAILED, ADOPTED = "exited", "restarted", "start_failed", "adopted"


@dataclass(frozen=True)
class SupervisionEvent:
    """What one supervision pass did to one child."""

    child: Child
    kind: str  # EXITED | RESTARTED | START_FAILED | ADOPTED (another process took the private Redis's place)
    message: str


def default_placement(policy: str) -> str:
    """Where `splitserve up` runs placement by default: in the coordinator ("local", one RPC less
    per request), except for LAPS, whose pool controller (Alg. 2) runs in the scheduler service
    and moves workers between the pools its placement reads."""
    return "scheduler" if policy == "laps" else "local"


def worker_options(spec: ClusterSpec, index: int) -> dict[str, object]:
    """What worker `index` of `spec` is told besides its ports and the common options: its id,
    model, role, `worker_args`, the scheduling policy, and the local batch policy of the design
    `spec.policy` names unless `worker_args` names another."""
    role = ("prefill" if index < spec.prefill_workers else "decode") if spec.prefill_workers else "both"
    return {"worker_id": f"worker-{index}", "model": spec.model, "role": role,
            "scheduling_policy": spec.scheduling_policy, **spec.worker_args, "batch_policy": spec.design.batch_policy}


def threads_per_worker(cores: int, workers: int) -> int:
    """torch threads of each of `workers` local workers on `cores` cores: an equal share, at least one.

    No core is kept back for the services' event loops: on 2 cores one worker with both
    serves 1.4x the tokens/s at saturation of one with a single thread, with the gateway in
    the same two cores (benchmarks/serve_vs_vllm.py); the event loops take their CPU between
    steps. Workers sharing cores would oversubscribe them (OpenMP threads spin)."""
    return max(1, cores // max(1, workers))


def _serve_cmd(service: str, options: dict[str, object]) -> list[str]:
    # faulthandler: a crash in native code (UCX, torch) leaves a Python stack in the log.
    cmd = [sys.executable, "-X", "faulthandler", "-m", "splitserve.cli", "serve", service]
    for key, value in options.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            cmd += [f"--{flag}", str(value)]
    return cmd


def coordinator_environment(options: dict[str, object]) -> dict[str, str]:
    """SPLITSERVE_COORDINATOR_* variables that configure an embedded coordinator like these flags would."""
    from splitserve.config import CoordinatorConfig, env_var

    fields = {f.name: f for f in dataclasses.fields(CoordinatorConfig)}
    env = {}
    for key, value in options.items():
        if key in fields and not fields[key].metadata.get("common"):
            env[env_var(CoordinatorConfig, fields[key])] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def start_cluster(spec: ClusterSpec, ready_timeout_s: float = 120.0) -> Cluster:
    """Start Redis (if needed), scheduler, coordinator, workers and gateway; wait until all are healthy."""
    if spec.coordinator not in ("process", "embedded"):
        raise ValueError(f"coordinator must be process or embedded, got {spec.coordinator!r}")
    internal_tls, gateway_tls = spec.internal_tls(), spec.gateway_tls()  # a bad option before anything starts
    scheduling_policy_option(spec.scheduling_policy)  # ValueError naming it, before anything starts
    fallback = spec.redis_url == DEFAULT_REDIS_URL if spec.redis_fallback is None else spec.redis_fallback
    redis_url, private = ensure_redis(spec.redis_url, fallback=fallback)  # RedisUnreachableError names it
    prefix = spec.redis_prefix or f"ss:{os.getpid()}-{int(time.time())}:"
    common = {"redis_url": redis_url, "redis_prefix": prefix, "host": spec.host, "log_json": spec.log_json}
    if spec.otlp_endpoint:
        common["otlp_endpoint"] = spec.otlp_endpoint
    if internal_tls is not None:  # every service: mTLS as server and as client
        common.update(mtls_ca_file=spec.mtls_ca_file, mtls_cert_file=spec.mtls_cert_file,
                      mtls_key_file=spec.mtls_key_file)
    gateway_public = {name: getattr(spec, name) for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
                      if getattr(spec, name)}
    # Every port is chosen before the services bind them (a worker binds its metrics port only
    # once its model is loaded): one not yet bound would look free again, so none is handed out twice.
    handed_out = {spec.http_port, spec.grpc_port}

    def free_port() -> int:
        while (port := pick_free_port()) in handed_out:
            pass
        handed_out.add(port)
        return port

    sched_port, coord_port = free_port(), free_port()
    scheduler_options = {**common, "port": sched_port, "policy": spec.policy, "metrics_port": 0, **spec.scheduler_args}
    coordinator_options = {**common, "port": coord_port, "scheduler_address": f"{spec.host}:{sched_port}",
                           "metrics_port": 0, "placement": spec.placement, "policy": spec.policy,
                           **{key: spec.scheduler_args[key] for key in ("split_ratio", "policy_params")
                              if key in spec.scheduler_args},
                           **spec.coordinator_args}
    plan: list[tuple[str, str, dict[str, object]]] = [("scheduler", f"{spec.host}:{sched_port}", scheduler_options)]
    gateway_env: dict[str, str] = {}
    if spec.coordinator == "process":
        plan.append(("coordinator", f"{spec.host}:{coord_port}", coordinator_options))
        coordinator_address = f"{spec.host}:{coord_port}"
    else:
        coordinator_address = "embedded"
        gateway_env = coordinator_environment(coordinator_options)
    if spec.prefill_workers >= spec.workers:
        raise ValueError(f"prefill_workers ({spec.prefill_workers}) must leave at least one decode worker "
                         f"of {spec.workers}")
    worker_addresses = []
    for i in range(spec.workers):
        port = free_port()
        worker_addresses.append(f"{spec.host}:{port}")
        plan.append((f"worker-{i}", f"{spec.host}:{port}",
                     {**common, "port": port, "metrics_port": 0, **worker_options(spec, i)}))
    plan.append(("gateway", f"{spec.host}:{spec.grpc_port}",
                 {**common, "port": spec.grpc_port, "http_port": spec.http_port, "model": spec.model,
                  "coordinator_address": coordinator_address, "scheduling_policy": spec.scheduling_policy,
                  **gateway_public, **spec.gateway_args}))

    children: list[Child] = []
    cluster = Cluster(spec, redis_url, prefix, children, private, f"{spec.host}:{spec.grpc_port}",
                      f"{'https' if gateway_tls else 'http'}://{spec.host}:{spec.http_port}", worker_addresses,
                      f"{spec.host}:{sched_port}", coordinator_address)
    if private is not None:
        cluster.redis_child = Child("redis", private.process, redis_url, None, cmd=private.argv)
    try:
        for name, address, options in plan:
            log_path = spec.log_dir / f"{name}.log" if spec.log_dir else None
            out = open(log_path, "ab") if log_path else subprocess.DEVNULL
            if name != "gateway":  # the gateway serves /metrics on its HTTP port
                options = {**options, "metrics_port": free_port()}
            env = {**os.environ, **gateway_env} if name == "gateway" and gateway_env else None
            cmd = _serve_cmd(name.split("-")[0], options)
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            children.append(Child(name, proc, address, log_path, int(options.get("metrics_port", 0)), cmd, env,
                                  tls=gateway_tls if name == "gateway" else internal_tls))
        # Gateway last in the list above, first to stop: reverse so SIGTERM reaches it first.
        children.reverse()
        deadline = time.monotonic() + ready_timeout_s
        wait_healthy(cluster, ready_timeout_s)
        wait_workers_placeable(cluster, max(1.0, deadline - time.monotonic()))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def wait_healthy(cluster: Cluster, timeout_s: float) -> None:
    """Poll every child's grpc.health.v1 until SERVING; raise naming the ones that are not."""
    deadline = time.monotonic() + timeout_s
    pending = {c.name: c for c in cluster.children}
    while pending:
        for name, child in list(pending.items()):
            if child.process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {child.process.returncode}{_log_tail(child)}")
            if _serving(child.grpc_address, child.tls):
                del pending[name]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {', '.join(sorted(pending))}")
        time.sleep(0.1)  # polling readiness, bounded by the deadline


def wait_workers_placeable(cluster: Cluster, timeout_s: float) -> None:
    """Poll the scheduler until its view holds every worker: a worker is SERVING once it has
    registered, but placement sees it only at the view's next refresh, and a request sent
    in between would be planned on fewer workers than the cluster has."""
    from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc

    deadline = time.monotonic() + timeout_s
    expected = len(cluster.worker_addresses)
    seen = 0
    with _channel(cluster.scheduler_address, cluster.spec.internal_tls()) as channel:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
        while True:
            try:
                seen = len(stub.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=1.0).workers)
            except grpc.RpcError:
                seen = 0
            if seen >= expected:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler sees {seen} of {expected} workers after {timeout_s:.0f} s")
            time.sleep(0.02)  # polling the scheduler's view, bounded by the deadline


def wait_port_healthy(address: str, process: subprocess.Popen, timeout_s: float,
                      tls: ClientTls | None = None) -> None:
    """Poll one service's health until SERVING; raise if its process exits first."""
    deadline = time.monotonic() + timeout_s
    while not _serving(address, tls):
        if process.poll() is not None:
            raise RuntimeError(f"service at {address} exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"service at {address} not healthy after {timeout_s:.0f} s")
        time.sleep(0.1)  # polling readiness, bounded by the deadline


def _channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    return grpc.insecure_channel(address) if tls is None else tls.channel(address)


def _serving(address: str, tls: ClientTls | None = None) -> bool:
    try:
        with _channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _log_tail(child: Child, lines: int = 15) -> str:
    if child.log_path is None or not child.log_path.exists():
        return ""
    tail = child.log_path.read_text(errors="replace").splitlines()[-lines:]
    return ":\n" + "\n".join(tail)
