"""The Docker deployment, really run: images built, `docker compose up`, requests, a killed worker, `down`.

What a user does with docker-compose.yml, on this machine: the images are built (the base from
Debian packages when no image registry answers: docker/build_base_image.sh; the project from
the wheelhouse `make wheels` fills), the cluster is started with the host-network override
(docker/compose.hostnet.yml: every packet on 127.0.0.1, free ports), and requests go through the
official OpenAI client and the SDK. Their outputs must equal the single-process engine's on the
same model directory (greedy). One worker container is killed mid-stream: the request completes
on the other worker, token for token, or fails with a retriable error. `down` must leave no
container, volume or network of the project.

Skipped, saying why, when no Docker engine answers, no compose (v2 `docker compose` or v1
`docker-compose`) is installed, no base image can be had, or the real model cannot be had.
Budget on this 2-core machine with a warm build cache: ~2-3 min (see docs/deployment.md).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
import yaml

from splitserve.redis_server import free_port
from redis_support import final_request_record
from real_model_support import FRANCE, FRANCE_ANSWER, PHOTOSYNTHESIS, chat_prompt_ids, real_model_dir

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("SPLITSERVE_TEST_IMAGE", "splitserve:cpu")
REDIS_IMAGES = ("redis:7.2-bookworm", "splitserve-redis:bookworm")
BASE_IMAGES = ("python:3.11-slim-bookworm", "splitserve-base:bookworm")
MAX_TOKENS = 48
KILL_TOKENS = 96
READY_TIMEOUT_S = 300.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(cmd: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _docker_ok() -> str | None:
    """Why Docker cannot be used here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        return "the Docker engine does not answer (docker info timed out)"
    if info.returncode != 0:
        return f"no Docker engine reachable: {(info.stderr or info.stdout).strip()[:200]}"
    return None


def compose_command() -> list[str] | None:
    """`docker compose` (v2) when it works, else `docker-compose` (v1); SPLITSERVE_COMPOSE overrides."""
    if os.environ.get("SPLITSERVE_COMPOSE"):
        return os.environ["SPLITSERVE_COMPOSE"].split()
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def _have_image(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def _base_images() -> tuple[str, str]:
    """(python base, redis image): the registry's when present, else the debootstrap ones (built once)."""
    base = next((b for b in BASE_IMAGES if _have_image(b)), None)
    redis = next((r for r in REDIS_IMAGES if _have_image(r)), None)
    if base is None or redis is None:
        proc = _run(["bash", "docker/build_base_image.sh"], timeout=900, check=False)
        if proc.returncode == 2:
            pytest.skip(f"no base image and none can be built here: {proc.stderr.strip()[-300:]}")
        assert proc.returncode == 0, f"docker/build_base_image.sh failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        base, redis = base or BASE_IMAGES[1], redis or REDIS_IMAGES[1]
    return base, redis


def _build_image(base: str) -> None:
    """`make wheels` when the wheelhouse is missing or older than pyproject.toml, then the image
    (layers cached by the engine: a warm rebuild after a source change redoes only /opt/app)."""
    constraints = ROOT / "docker/wheelhouse/constraints.txt"
    if not constraints.exists() or constraints.stat().st_mtime < (ROOT / "pyproject.toml").stat().st_mtime:
        _run(["bash", "docker/make_wheelhouse.sh", str(Path(sys.executable).parent.parent)], timeout=900)
    _run(["docker", "build", "-q", "-t", IMAGE, "--build-arg", f"BASE_IMAGE={base}", "."], timeout=1200)


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("splitserve_healthcheck", ROOT / "docker/healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Compose:
    """One compose project on the host network, from the merged config with published ports removed
    (Compose v1 refuses port bindings with network_mode host; v2 would only warn)."""

    def __init__(self, cmd: list[str], tmp: Path, env: dict[str, str], overrides: tuple[str, ...] = ()):
        self.cmd, self.env = cmd, {**os.environ, **env}
        self.project = f"sse2e{uuid.uuid4().hex[:8]}"
        files = ["docker-compose.yml", "docker/compose.hostnet.yml", *overrides]
        merged = _run([*cmd, "-p", self.project, *(arg for f in files for arg in ("-f", f)), "config"],
                      env=self.env, timeout=60).stdout
        config = yaml.safe_load(merged)
        for service in config["services"].values():
            service.pop("ports", None)
        self.file = tmp / "compose.hostnet.merged.yml"
        self.file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.down_done = False

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.cmd, "-p", self.project, "-f", str(self.file), *args], env=self.env, timeout=timeout,
                    check=check)

    def containers(self, service: str | None = None, all_states: bool = True) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = _run(["docker", "ps", "-q", *(["-a"] if all_states else []), *filters]).stdout
        return out.split()

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: _run(["docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []),
                             "--filter", label]).stdout.split()
                for kind in ("container", "volume", "network")}

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "40", check=False).stdout[-12000:]


@pytest.fixture(scope="module")
def images():
    """What every deployment here needs: Docker, compose, the model, the images (built once)."""
    why = _docker_ok()
    if why:
        pytest.skip(f"Docker deployment test skipped: {why}")
    cmd = compose_command()
    if cmd is None:
        pytest.skip("Docker deployment test skipped: neither `docker compose` (v2) nor `docker-compose` (v1)")
    model_dir = real_model_dir()
    started = time.monotonic()
    base, redis_image = _base_images()
    _build_image(base)
    return {"cmd": cmd, "model_dir": model_dir, "redis_image": redis_image, "built_s": time.monotonic() - started,
            "started": started}


@pytest.fixture(scope="module")
def deployment(images, tmp_path_factory):
    ports = {name: free_port() for name in ("redis", "scheduler", "coordinator", "grpc", "http")}
    env = _host_env(ports, images["model_dir"], images["redis_image"], workers=2)
    compose = Compose(images["cmd"], tmp_path_factory.mktemp("compose"), env)
    try:
        compose("up", "-d", "--no-build", timeout=READY_TIMEOUT_S)
        http, grpc_address = f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}"
        _wait_ready(compose, http, f"127.0.0.1:{ports['scheduler']}", workers=2)
        yield {"compose": compose, "http": http, "grpc": grpc_address, "scheduler": f"127.0.0.1:{ports['scheduler']}",
               "redis_url": f"redis://127.0.0.1:{ports['redis']}/0",
               "model_dir": images["model_dir"], "ready_s": time.monotonic() - images["started"],
               "built_s": images["built_s"]}
    finally:
        if not compose.down_done:
            compose("down", "-v", "--remove-orphans", "-t", "20", check=False)


def _host_env(ports: dict[str, int], model_dir: Path, redis_image: str, workers: int) -> dict[str, str]:
    return {
        "SPLITSERVE_IMAGE": IMAGE, "SPLITSERVE_REDIS_IMAGE": redis_image, "SPLITSERVE_MODEL_DIR": str(model_dir),
        "SPLITSERVE_WORKERS": str(workers), "SPLITSERVE_WORKER_NUM_THREADS": "1",
        "SPLITSERVE_REDIS_PORT": str(ports["redis"]),
        "SPLITSERVE_REDIS_URL": f"redis://127.0.0.1:{ports['redis']}/0",
        "SPLITSERVE_SCHEDULER_PORT": str(ports["scheduler"]),
        "SPLITSERVE_COORDINATOR_PORT": str(ports["coordinator"]),
        "SPLITSERVE_COORDINATOR_SCHEDULER_ADDRESS": f"127.0.0.1:{ports['scheduler']}",
        "SPLITSERVE_GATEWAY_COORDINATOR_ADDRESS": f"127.0.0.1:{ports['coordinator']}",
        "SPLITSERVE_GATEWAY_PORT": str(ports["grpc"]), "SPLITSERVE_GATEWAY_HTTP_PORT": str(ports["http"]),
        "SPLITSERVE_DRAIN_TIMEOUT_S": "10", "SPLITSERVE_STOP_GRACE": "20s",
    }


def _wait_ready(compose: Compose, http: str, scheduler: str, workers: int, verify: object = True,
                scheduler_tls: object = None) -> None:
    """Every container healthy (Docker's health checks), /health 200, the scheduler sees every worker.
    `verify`: httpx's, for an https gateway; `scheduler_tls`: a ClientTls for an mTLS scheduler."""
    from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc
    from splitserve.tls import plain_or_tls_channel

    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        ids = compose.containers(all_states=False)
        states = _run(["docker", "inspect", "-f", "{{.Name}} {{.State.Status}} {{if .State.Health}}"
                       "{{.State.Health.Status}}{{end}}", *ids]).stdout.split("\n") if ids else []
        unhealthy = [s for s in states if s.strip() and not s.strip().endswith("healthy")]
        exited = [s for s in states if " exited " in s or " dead " in s]
        assert not exited, f"containers exited: {exited}\n{compose.logs()}"
        seen = 0
        if not unhealthy and len(ids) == 4 + workers:
            try:
                if httpx.get(f"{http}/health", timeout=2, verify=verify).status_code == 200:
                    with plain_or_tls_channel(scheduler, scheduler_tls) as channel:
                        stub = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
                        seen = len(stub.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=2).workers)
            except (httpx.HTTPError, grpc.RpcError, OSError):
                pass
            if seen >= workers:
                return
        assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S:.0f} s: {states}\n{compose.logs()}"
        time.sleep(1.0)  # polling container health, bounded by the deadline


@pytest.fixture(scope="module")
def tokenizer(images):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(images["model_dir"]))


@pytest.fixture(scope="module")
def reference(images, tokenizer):
    """The single-process engine on the same model directory, greedy: {name: CompletionOutput}."""
    from workers.engine import LLM, SamplingParams

    llm = LLM(str(images["model_dir"]))
    chats = {"france": FRANCE, "photosynthesis": PHOTOSYNTHESIS}
    outs = llm.generate([chat_prompt_ids(tokenizer, c) for c in chats.values()],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    refs = dict(zip(chats, outs))
    refs["long"] = llm.generate([chat_prompt_ids(tokenizer, PHOTOSYNTHESIS)],
                                SamplingParams(max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True))[0]
    return refs


def test_images_build_and_report_size(deployment):
    size = int(_run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE]).stdout.strip())
    user = _run(["docker", "image", "inspect", "-f", "{{.Config.User}}", IMAGE]).stdout.strip()
    print(f"\n{IMAGE}: {size / 1e9:.2f} GB; built/checked in {deployment['built_s']:.0f} s, "
          f"cluster ready after {deployment['ready_s']:.0f} s")
    assert user and not user.startswith("0") and user != "root"
    tools = _run(["docker", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c",
                  "for t in gcc cc make pip pip3 apt-get; do command -v $t || true; done"]).stdout.split()
    assert not [t for t in tools if "apt-get" not in t], f"build tools in the final image: {tools}"


def test_openai_client_matches_engine(deployment, reference):
    import openai

    client = openai.OpenAI(base_url=f"{deployment['http']}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == reference["france"].text == FRANCE_ANSWER
    stream = client.chat.completions.create(model=model, messages=PHOTOSYNTHESIS, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference["photosynthesis"].text


def test_sdk_matches_engine(deployment, reference, tokenizer):
    from splitserve.client import Client

    with Client(deployment["grpc"], timeout_s=120) as client:
        for name, chat in (("france", FRANCE), ("photosynthesis", PHOTOSYNTHESIS)):
            out = client.generate(chat_prompt_ids(tokenizer, chat), max_tokens=MAX_TOKENS, temperature=0.0)
            assert out.token_ids == reference[name].token_ids, name


def test_worker_killed_mid_stream(deployment, reference, tokenizer):
    """A worker container killed while it streams: the request migrates to the worker left and
    completes with the tokens one engine produces (no error reaches the client, which does not
    retry); the cluster then serves on that worker."""
    from splitserve.client import Client

    compose = deployment["compose"]
    received: list[int] = []
    errors: list[BaseException] = []
    prompt = chat_prompt_ids(tokenizer, PHOTOSYNTHESIS)
    request_id = f"compose-kill-{uuid.uuid4().hex[:8]}"

    def consume() -> None:
        try:
            with Client(deployment["grpc"], timeout_s=180, max_retries=0) as client:
                for chunk in client.stream(prompt, max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True,
                                           request_id=request_id):
                    received.extend(chunk.token_ids)
        except BaseException as err:  # noqa: BLE001 (handed to the test thread)
            errors.append(err)

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 60
    while len(received) < 8:
        assert thread.is_alive(), f"the stream ended after {len(received)} tokens, before the kill: {errors}"
        assert time.monotonic() < deadline, "no tokens within 60 s"
        time.sleep(0.02)  # polling the stream, bounded by the deadline
    victim, victim_worker = _container_running_request(compose, deployment["scheduler"])
    _run(["docker", "kill", victim])
    killed_at = len(received)
    thread.join(timeout=180)
    assert not thread.is_alive(), "the stream neither finished nor failed within 180 s of the kill"
    assert killed_at < KILL_TOKENS, "the request had finished before the kill"
    assert not errors, f"the stream failed after the kill at token {killed_at}: {errors[0]!r}"
    assert received == reference["long"].token_ids, f"killed at token {killed_at}: the output differs"
    # Finished by the worker left, so migrated: not done before the kill reached it (a client can
    # read behind the cluster).
    record = final_request_record(SimpleNamespace(redis_url=deployment["redis_url"], redis_prefix="ss:"), request_id)
    assert record is not None and record.state == "length", record
    assert record.stages[-1]["worker_id"] != victim_worker, (victim_worker, record.stages)
    with Client(deployment["grpc"], timeout_s=120) as client:  # the worker left still serves
        out = client.generate(chat_prompt_ids(tokenizer, FRANCE), max_tokens=MAX_TOKENS, temperature=0.0)
    assert out.token_ids == reference["france"].token_ids


def _container_running_request(compose: Compose, scheduler: str) -> tuple[str, str]:
    """The worker container whose worker runs a request, and that worker's id: <host>-<port> on the
    host network, the port is found among the sockets of each worker container's process."""
    from splitserve.proto import scheduler_pb2, scheduler_pb2_grpc

    health = _healthcheck_module()
    deadline = time.monotonic() + 20
    with grpc.insecure_channel(scheduler) as channel:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(channel)
        while True:
            busy = [w.worker_id for w in stub.ClusterState(scheduler_pb2.ClusterStateRequest(), timeout=2).workers
                    if w.running]
            if busy:
                break
            assert time.monotonic() < deadline, "no worker reports a running request"
            time.sleep(0.05)  # polling the scheduler's view, bounded by the deadline
    port = int(busy[0].rsplit("-", 1)[1])
    for cid in compose.containers("worker", all_states=False):
        pid = int(_run(["docker", "inspect", "-f", "{{.State.Pid}}", cid]).stdout.strip())
        if port in health.listening_ports(pid):
            return cid, busy[0]
    raise AssertionError(f"no worker container listens on {port}")


def test_stop_drains_and_down_leaves_nothing(deployment):
    compose = deployment["compose"]
    started = time.monotonic()
    compose("stop", "-t", "20", timeout=120)
    stop_s = time.monotonic() - started
    codes = {}
    for cid in compose.containers(all_states=True):
        name, code, oom = _run(["docker", "inspect", "-f", "{{.Name}} {{.State.ExitCode}} {{.State.OOMKilled}}",
                                cid]).stdout.split()
        codes[name] = int(code)
    # The killed worker exited 137 (unless Docker restarted it); every service stopped by SIGTERM
    # drained and exited 0 within the grace period.
    killed = [n for n, c in codes.items() if c == 137]
    assert len(killed) <= 1 and all("worker" in n for n in killed), codes
    assert all(c == 0 for n, c in codes.items() if n not in killed), f"not stopped gracefully: {codes}"
    compose("down", "-v", "--remove-orphans", "-t", "20", timeout=120)
    compose.down_done = True
    print(f"\nstop took {stop_s:.1f} s")
    assert compose.leftovers() == {"container": [], "volume": [], "network": []}


def test_tls_override_serves_over_https_and_grpc_with_mtls_inside(images, reference, tokenizer, tmp_path):
    """docker/compose.tls.yml on the host network, one worker: every service speaks mTLS (the
    containers' health checks too), the gateway TLS on both APIs; answers equal the engine's.
    Last in the file: the plain deployment is down by then (the test above), so one cluster
    runs at a time."""
    from splitserve.client import Client
    from splitserve.tls import ClientTls
    from tests.tls_support import make_test_certs

    if os.geteuid() != 0:
        pytest.skip("the TLS compose test gives the keys to the image's user (uid 10001): it needs root")
    certs = make_test_certs(tmp_path / "certs", key_owner=(10001, 10001))  # as make_certs.py --key-owner 10001
    ports = {name: free_port() for name in ("redis", "scheduler", "coordinator", "grpc", "http")}
    env = {**_host_env(ports, images["model_dir"], images["redis_image"], workers=1),
           "SPLITSERVE_CERTS_DIR": str(tmp_path / "certs")}
    compose = Compose(images["cmd"], tmp_path, env, overrides=("docker/compose.tls.yml",))
    ca = ClientTls(str(certs["ca"]))
    try:
        compose("up", "-d", "--no-build", timeout=READY_TIMEOUT_S)
        http, scheduler = f"https://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['scheduler']}"
        services = ClientTls(str(certs["ca"]), str(certs["service"]), str(certs["service_key"]))
        _wait_ready(compose, http, scheduler, workers=1, verify=ca.ssl_context(), scheduler_tls=services)
        body = {"model": "smollm2-135m-instruct", "messages": FRANCE, "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{http}/v1/chat/completions", json=body, timeout=120, verify=ca.ssl_context())
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == reference["france"].text
        with Client(f"127.0.0.1:{ports['grpc']}", ca_file=str(certs["ca"]), timeout_s=120) as client:
            out = client.generate(chat_prompt_ids(tokenizer, PHOTOSYNTHESIS), max_tokens=MAX_TOKENS, temperature=0.0)
        assert out.token_ids == reference["photosynthesis"].token_ids
        with pytest.raises(httpx.HTTPError):  # plaintext to the TLS listener
            httpx.get(f"http://127.0.0.1:{ports['http']}/health", timeout=5)
        with grpc.insecure_channel(scheduler) as channel:  # plaintext to an mTLS service
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        compose("down", "-v", "--remove-orphans", "-t", "20", check=False)
    assert compose.leftovers() == {"container": [], "volume": [], "network": []}
