"""Find a reachable Redis, or start a private `redis-server` on a free port."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse


# Below Linux's default ephemeral range (32768-60999): outgoing connections never take
# these, so a port picked here stays free until the service we start binds it.
_PORT_RANGE = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, outside the ephemeral range."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # crowded range: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    """True when something at `url` answers PING with PONG."""
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            if parsed.password:
                s.sendall(f"AUTH {parsed.password}\r\n".encode())
                s.recv(64)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class PrivateRedis:
    """A redis-server child process that keeps nothing on disk; `argv` starts it again on the
    same port (a supervisor replaces `process` when it does)."""

    url: str
    process: subprocess.Popen
    workdir: str
    argv: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_private_redis(timeout_s: float = 10.0) -> PrivateRedis:
    """Start `redis-server` on a free loopback port and wait until it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "no Redis is reachable and redis-server is not on PATH; install it "
            "(Debian: apt-get install redis-server) or pass --redis-url"
        )
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="splitserve-redis-")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--daemonize", "no", "--loglevel", "warning"]
    # Its own session: Ctrl-C at `splitserve up` reaches the services, which drain while Redis
    # still answers; `Cluster.stop` stops it last. Errors to a file read only if it fails to start.
    errors = open(os.path.join(workdir, "redis-server.log"), "wb")
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
    finally:
        errors.close()
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(os.path.join(workdir, "redis-server.log"), "rb") as log:
                err = log.read().decode(errors="replace")
            raise RuntimeError(f"redis-server exited with code {proc.returncode}: {err.strip()}")
        if redis_reachable(url):
            return PrivateRedis(url, proc, workdir, argv)
        time.sleep(0.05)  # polling for readiness, bounded by the deadline
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s} s")


def ensure_redis(url: str) -> tuple[str, PrivateRedis | None]:
    """Use `url` when it answers, else start a private server; returns (url, private or None)."""
    if redis_reachable(url):
        return url, None
    private = start_private_redis()
    return private.url, private
