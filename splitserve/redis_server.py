"""Find a reachable Redis, or start a private `redis-server` on a free port.

Reachability is probed with redis-py, as the services connect (every URL form it reads); only
the default URL, configured by nobody, may be replaced by a private server (`ensure_redis`)."""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

# The Redis `splitserve up` uses when none is configured; only this one may be replaced by a
# private redis-server when it does not answer.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


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


class RedisUnreachableError(RuntimeError):
    """A Redis that was asked for by URL does not answer (the message names it, password masked)."""


def mask_url(url: str) -> str:
    """`url` for logs and errors: its password (`user:PASSWORD@`, `?password=`) as ***; the user
    name stays when a password follows it, a lone `NAME@` (often a password put there) is masked."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@(.*)", url, re.S)
    if match:
        scheme, userinfo, rest = match.groups()
        user, colon, _ = userinfo.partition(":")
        url = f"{scheme}{user}:***@{rest}" if colon and user else f"{scheme}***@{rest}"
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)


def _without_secrets(text: str, url: str) -> str:
    """`text` (an error's message) with the URL's password, should it quote it, as ***."""
    parts = urlsplit(url)
    secrets = [parts.password, unquote(parts.password)] if parts.password else []
    secrets += parse_qs(parts.query).get("password", [])
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def redis_unreachable_reason(url: str, timeout_s: float = 0.5) -> str | None:
    """None when the Redis at `url` answers PING, else why not. It connects as the services'
    redis-py clients do (`from_url`: redis://, rediss:// with its ssl_* query options, unix://
    sockets, `user:password@` ACL users, `?db=`), so what answers here answers them; timeouts the
    URL sets itself win over `timeout_s`."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:  # no redis-py retries: an unreachable Redis is reported after one try
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0))
    except ValueError as err:  # not a URL redis-py reads
        return f"not a Redis URL: {err}"
    try:
        return None if client.ping() else "PING was not answered with PONG"
    except Exception as err:  # noqa: BLE001 - connection, TLS, authentication, ACL: all "does not answer"
        return f"{type(err).__name__}: {err}"
    finally:
        client.close()


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    """True when the Redis at `url` answers PING (see `redis_unreachable_reason`)."""
    return redis_unreachable_reason(url, timeout_s) is None


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


def ensure_redis(url: str | None = None, *, fallback: bool = True,
                 timeout_s: float = 2.0) -> tuple[str, PrivateRedis | None]:
    """The Redis to use: `url` (None: `DEFAULT_REDIS_URL`) when it answers, as (url, None).

    When it does not answer: with `fallback`, a private redis-server is started, as (its url, it);
    without, RedisUnreachableError naming the URL (password masked) and why. A caller whose user
    configured the URL passes fallback=False: such a Redis is never silently replaced by another."""
    url = url or DEFAULT_REDIS_URL
    reason = redis_unreachable_reason(url, timeout_s)
    if reason is None:
        return url, None
    if not fallback:
        raise RedisUnreachableError(
            f"Redis at {mask_url(url)} does not answer ({_without_secrets(reason, url)}); it was configured "
            f"explicitly, so no private redis-server is started in its place: start that Redis or fix the "
            f"URL (unset, {DEFAULT_REDIS_URL} is used, or a private redis-server when it does not answer)")
    private = start_private_redis()
    return private.url, private
