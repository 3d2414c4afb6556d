"""The cluster's processes that chaos kills: the services `splitserve up` started (by their command
line) and Redis."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from splitserve.cli.chaos.options import WORKER, ChaosError

if TYPE_CHECKING:  # splitserve.tls imports grpc; `splitserve simulate` mounts this module without it
    from splitserve.tls import ClientTls


# ---- the cluster's processes ----------------------------------------------------------------


@dataclass(frozen=True)
class ServiceProcess:
    """A service process of the cluster, read from its command line."""

    pid: int
    service: str  # scheduler | coordinator | worker | gateway
    name: str  # the worker's id (worker-0, ...), else the service
    port: int | None  # its gRPC port


def _flag(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def parse_service_cmdline(pid: int, argv: Sequence[str], prefix: str) -> ServiceProcess | None:
    """The service this command line runs for the cluster with `prefix`, or None."""
    if "serve" not in argv or _flag(argv, "--redis-prefix") != prefix:
        return None
    at = argv.index("serve")
    launched_by_cli = any(arg == "splitserve.cli" or os.path.basename(arg) == "splitserve" for arg in argv[:at])
    if not launched_by_cli or at + 1 >= len(argv):
        return None
    service = argv[at + 1]
    name = (_flag(argv, "--worker-id") or "") if service == WORKER else service
    port = _flag(argv, "--port")
    return ServiceProcess(pid, service, name, int(port) if port and port.isdigit() else None)


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone, or not ours to read
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def find_service_processes(prefix: str) -> list[ServiceProcess]:
    """This user's live service processes of the cluster whose Redis prefix is `prefix`
    (zombies, whose command line is empty, are not live)."""
    found = []
    uid = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        service = parse_service_cmdline(pid, _cmdline(pid), prefix)
        if service is not None:
            found.append(service)
    return sorted(found, key=lambda s: (s.service, s.name, s.pid))


def kill_service(victim: ServiceProcess, prefix: str) -> None:
    """SIGKILL the victim, after checking its pid still runs the same service (pids are reused)."""
    again = parse_service_cmdline(victim.pid, _cmdline(victim.pid), prefix)
    if again is None or again.name != victim.name:
        raise ProcessLookupError(f"{victim.name} (pid {victim.pid}) is gone")
    os.kill(victim.pid, signal.SIGKILL)


def grpc_serving(port: int | None, tls: ClientTls | None = None) -> bool:
    if port is None:
        return True
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.tls import plain_or_tls_channel

    try:
        with plain_or_tls_channel(f"127.0.0.1:{port}", tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


# ---- Redis --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RedisProcess:
    """The redis-server behind the cluster's URL and how to start it again (redis rewrites its
    process title, so the command line is rebuilt from its own configuration)."""

    pid: int
    argv: tuple[str, ...]
    cwd: str
    executable: str
    supervised: bool = False  # a child of `splitserve up`, which restarts it: chaos only waits


def _supervised_by_up(pid: int) -> bool:
    """Whether the process's parent is a `splitserve up` (it restarts the private Redis it started)."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        argv = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, IndexError, ValueError):
        return False
    return "up" in argv and any(arg.endswith("splitserve") or arg == "splitserve.cli" for arg in argv)


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def find_redis_process(url: str, prefix: str) -> RedisProcess:
    """Find the cluster's redis-server; ChaosError when it is not this cluster's alone to kill."""
    import redis

    client = redis_client(url)
    try:
        info = client.info("server")
        foreign: set[str] = set()
        for key in client.scan_iter(count=1000):
            text = key.decode(errors="replace")
            if not text.startswith(prefix):
                parts = text.split(":")
                foreign.add(":".join(parts[:2]) + ":" if len(parts) > 2 else text)
                if len(foreign) >= 5:
                    break
        config = {name: client.config_get(name).get(name, "") for name in ("port", "bind", "dir", "save",
                                                                           "appendonly")}
    except redis.RedisError as err:
        raise ChaosError(f"cannot read Redis at {url}: {err}") from None
    finally:
        client.close()
    if foreign:
        raise ChaosError(f"refusing to kill Redis at {url}: it holds keys of others too (e.g. "
                         f"{', '.join(sorted(foreign))}), not only the cluster's {prefix!r}; start the cluster on "
                         f"its own Redis to try Redis faults")
    pid = int(info["process_id"])
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError as err:
        raise ChaosError(f"Redis at {url} (pid {pid}) is not a process of this machine we can see: {err}") from None
    if owner != os.getuid():
        raise ChaosError(f"refusing to kill Redis at {url}: pid {pid} belongs to another user")
    # INFO's executable may be relative to the directory it started in; /proc's is the real file
    # (on Debian a multi-call binary, told what to be by argv[0]).
    named = str(info.get("executable") or "redis-server")
    try:
        executable = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        executable = named
    argv = [os.path.basename(named) or "redis-server"]
    if info.get("config_file"):
        argv.append(str(info["config_file"]))
    as_str = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in config.items()}
    argv += ["--port", as_str["port"], "--bind", as_str["bind"] or "127.0.0.1", "--dir", as_str["dir"],
             "--save", as_str["save"], "--appendonly", as_str["appendonly"] or "no", "--daemonize", "no"]
    return RedisProcess(pid, tuple(argv), cwd, executable, _supervised_by_up(pid))


def redis_answers(url: str) -> bool:
    import redis

    client = redis_client(url)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()
