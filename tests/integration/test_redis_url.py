"""Which Redis `splitserve up` uses: every URL form redis-py reads is probed as the services'
clients connect (plain, `user:password@` ACL users, unix sockets, rediss://), and a URL the user
configured that does not answer stops `up` with an error naming it (password masked) instead of
a private redis-server silently taking its place. Only the default URL may be replaced.

Against the real Redis at 127.0.0.1:6379 (skipped when none answers there); the unix-socket and
TLS servers are private redis-servers this module starts and stops (skipped without one on PATH).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from splitserve.redis_server import (DEFAULT_REDIS_URL, RedisUnreachableError, ensure_redis, free_port, mask_url,
                                     redis_reachable)

REPO_ROOT = Path(__file__).resolve().parents[2]
REAL_HOST, REAL_PORT = "127.0.0.1", 6379
REAL_URL = f"redis://{REAL_HOST}:{REAL_PORT}/0"


def _answers(**kwargs) -> bool:
    client = redis.Redis(socket_connect_timeout=0.5, socket_timeout=0.5, **kwargs)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


@pytest.fixture
def real_redis() -> redis.Redis:
    """A client of the real Redis at 127.0.0.1:6379, or a skip saying why not."""
    if not _answers(host=REAL_HOST, port=REAL_PORT):
        pytest.skip(f"no Redis answers at {REAL_HOST}:{REAL_PORT} (these tests use the real one: start redis-server)")
    client = redis.Redis(host=REAL_HOST, port=REAL_PORT, socket_connect_timeout=2, socket_timeout=2)
    yield client
    client.close()


@pytest.fixture
def acl_user(real_redis):
    """A temporary ACL user on the real Redis, (name, password), deleted after the test. The
    password holds characters a URL must percent-encode."""
    name, password = f"ss-test-{uuid.uuid4().hex[:8]}", f"p@ss:/w{uuid.uuid4().hex[:8]}"
    try:
        real_redis.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", "~*", "&*", "+@all")
    except redis.ResponseError as err:
        pytest.skip(f"cannot create an ACL user on the Redis at {REAL_HOST}:{REAL_PORT}: {err}")
    try:
        yield name, password
    finally:
        real_redis.execute_command("ACL", "DELUSER", name)


def _resolved(url: str) -> str:
    """What ensure_redis(url, fallback=False) resolves `url` to (a private Redis it started instead is stopped)."""
    resolved, private = ensure_redis(url, fallback=False)
    if private is not None:
        private.stop()
        return f"a private Redis at {resolved}"
    return resolved


def _refusal(url: str) -> str:
    """The message of the error ensure_redis(url, fallback=False) raises (the test fails, and a
    private Redis started instead is stopped, when it raises none)."""
    try:
        resolved = _resolved(url)
    except RedisUnreachableError as err:
        return str(err)
    pytest.fail(f"{mask_url(url)} was resolved to {resolved}, not refused")


def _unanswered_url(userinfo: str = "") -> str:
    """A redis:// URL on a loopback port nothing listens on."""
    return f"redis://{userinfo}127.0.0.1:{free_port()}/0"


class _Server:
    """A private redis-server on argv's listeners (no persistence), stopped and removed by `stop`."""

    def __init__(self, workdir: Path, *options: str):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self.workdir = workdir
        self.log = open(workdir / "redis-server.log", "wb")
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir),
             "--daemonize", "no", "--loglevel", "warning", *options],
            stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)

    def wait_until(self, answers, timeout_s: float = 10.0, skip_if_log_says: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not answers():
            if self.process.poll() is not None:
                log = (self.workdir / "redis-server.log").read_text()
                if skip_if_log_says and skip_if_log_says in log.lower():
                    pytest.skip(f"this redis-server cannot serve the test: {log.strip()[-300:]}")
                raise AssertionError(f"redis-server exited with {self.process.returncode}: {log}")
            assert time.monotonic() < deadline, f"redis-server did not answer within {timeout_s} s"
            time.sleep(0.05)  # polling for readiness, bounded by the deadline

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.log.close()


@pytest.fixture
def short_tmp():
    """A short directory (a unix socket's path must fit in 108 bytes), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="ss-redis-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---- the probe: every URL form, as redis-py connects --------------------------------------------------


def test_a_plain_url_that_answers_is_used(real_redis):
    for url in (REAL_URL, f"redis://{REAL_HOST}:{REAL_PORT}/3", f"redis://{REAL_HOST}:{REAL_PORT}?db=2"):
        assert redis_reachable(url)
        assert _resolved(url) == url


def test_an_acl_user_url_is_probed_as_that_user(acl_user):
    name, password = acl_user
    url = f"redis://{quote(name)}:{quote(password, safe='')}@{REAL_HOST}:{REAL_PORT}/0"
    assert redis_reachable(url)
    assert _resolved(url) == url

    # A wrong password is an error naming the URL, never the password, and no other Redis.
    wrong_password = f"wrong{uuid.uuid4().hex[:8]}"
    wrong = f"redis://{quote(name)}:{wrong_password}@{REAL_HOST}:{REAL_PORT}/0"
    assert not redis_reachable(wrong)
    message = _refusal(wrong)
    assert f"redis://{name}:***@{REAL_HOST}:{REAL_PORT}/0" in message and wrong_password not in message, message
    assert "AuthenticationError" in message, message


def test_a_unix_socket_url_is_probed_on_that_socket(short_tmp):
    socket_path = short_tmp / "redis.sock"
    server = _Server(short_tmp, "--port", "0", "--unixsocket", str(socket_path), "--unixsocketperm", "700")
    try:
        server.wait_until(lambda: socket_path.exists() and _answers(unix_socket_path=str(socket_path)))
        url = f"unix://{socket_path}?db=0"
        assert redis_reachable(url)
        assert _resolved(url) == url
        client = redis.Redis.from_url(url, socket_timeout=2)
        try:  # the probe reached this server, not some Redis on a TCP port
            assert client.config_get("unixsocket")["unixsocket"] == str(socket_path)
        finally:
            client.close()
    finally:
        server.stop()
    gone = f"unix://{socket_path}?db=0"
    assert not redis_reachable(gone)
    assert f"Redis at {gone} does not answer" in _refusal(gone)


def test_a_rediss_url_is_probed_over_tls(short_tmp):
    from tls_support import make_test_certs  # tests/ (beside the root conftest) is on sys.path

    certs = make_test_certs(short_tmp / "certs")
    port = free_port()
    server = _Server(short_tmp, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["service"]),
                     "--tls-key-file", str(certs["service_key"]), "--tls-ca-cert-file", str(certs["ca"]),
                     "--tls-auth-clients", "no")
    try:
        server.wait_until(lambda: _answers(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(certs["ca"])),
                          skip_if_log_says="tls")  # a build without TLS
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={quote(str(certs['ca']))}"
        assert redis_reachable(url)
        assert _resolved(url) == url
        plaintext = f"redis://127.0.0.1:{port}/0"  # the TLS port does not answer plaintext RESP
        assert not redis_reachable(plaintext)
        assert f"Redis at {plaintext} does not answer" in _refusal(plaintext)
    finally:
        server.stop()


def test_masked_urls_keep_the_user_and_hide_the_password():
    assert mask_url("redis://alice:s3cret@h:6379/0") == "redis://alice:***@h:6379/0"
    assert mask_url("rediss://:s3cret@h:6380/1") == "rediss://***@h:6380/1"
    assert mask_url("redis://s3cret@h") == "redis://***@h"  # a lone name: often a password put there
    assert mask_url("unix://alice:s%40cret@/run/redis.sock?db=1") == "unix://alice:***@/run/redis.sock?db=1"
    assert mask_url("redis://h/0?db=1&password=s3cret") == "redis://h/0?db=1&password=***"
    assert mask_url(REAL_URL) == REAL_URL


# ---- which Redis: only the default URL may be replaced by a private redis-server -------------------


def test_an_explicit_url_that_does_not_answer_is_an_error_and_starts_nothing():
    url = _unanswered_url("alice:s3cret@")
    message = _refusal(url)
    assert mask_url(url) in message and "s3cret" not in message and "ConnectionError" in message, message


def test_a_url_that_does_not_answer_may_fall_back_only_when_asked():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (Debian: apt-get install redis-server)")
    url = _unanswered_url()
    resolved, private = ensure_redis(url, fallback=True)  # what the default URL gets
    try:
        assert private is not None and resolved == private.url != url and redis_reachable(resolved)
    finally:
        if private is not None:
            private.stop()


@pytest.mark.parametrize("spec_kwargs, fallback", [
    ({}, True),  # nothing configured: the default, which a private server may replace
    ({"redis_url": DEFAULT_REDIS_URL, "redis_fallback": False}, False),  # the default, named by the user
    ({"redis_url": "redis://127.0.0.1:6380/0"}, False),  # any other URL must answer
    ({"redis_url": "unix:///run/redis.sock", "redis_fallback": True}, True),  # a caller may allow it
])
def test_the_launcher_lets_only_the_default_url_fall_back(monkeypatch, tmp_path, spec_kwargs, fallback):
    import splitserve.cli.launcher as launcher

    calls = []

    def fake_ensure_redis(url, *, fallback):
        calls.append((url, fallback))
        raise RedisUnreachableError("stop here")  # before anything starts

    monkeypatch.setattr(launcher, "ensure_redis", fake_ensure_redis)
    with pytest.raises(RedisUnreachableError, match="stop here"):
        launcher.start_cluster(launcher.ClusterSpec(model=str(tmp_path), **spec_kwargs))
    assert calls == [(spec_kwargs.get("redis_url", DEFAULT_REDIS_URL), fallback)]


@pytest.mark.parametrize("how", ["option", "environment", "unset"])
def test_up_passes_whether_the_user_configured_the_url(monkeypatch, tmp_path, how):
    """`--redis-url` and SPLITSERVE_REDIS_URL are configurations (a private Redis may not replace
    them, the default URL among them); nothing configured is the default, which it may."""
    from typer.testing import CliRunner

    import splitserve.cli.launcher as launcher
    from splitserve.cli.app import app

    specs = []

    def fake_start_cluster(spec, *args, **kwargs):
        specs.append(spec)
        raise RuntimeError("stop here")

    monkeypatch.setattr(launcher, "start_cluster", fake_start_cluster)
    monkeypatch.delenv("SPLITSERVE_REDIS_URL", raising=False)
    args = ["up", "--model", str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--workers", "1"]
    if how == "option":
        args += ["--redis-url", DEFAULT_REDIS_URL]
    elif how == "environment":
        monkeypatch.setenv("SPLITSERVE_REDIS_URL", DEFAULT_REDIS_URL)
    previous = signal.getsignal(signal.SIGTERM)  # `up` handles SIGTERM while it starts
    try:
        result = CliRunner().invoke(app, args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 1 and "stop here" in result.output, result.output
    assert [(s.redis_url, s.redis_fallback) for s in specs] == [(DEFAULT_REDIS_URL, how == "unset")]


@pytest.mark.parametrize("how", ["option", "environment"])
def test_splitserve_up_with_an_explicit_url_that_does_not_answer_fails_naming_it(tmp_path, how):
    """The real command, as a user runs it: exit 1, the URL in the error with its password masked,
    and no cluster on a private Redis in its place."""
    url = _unanswered_url("alice:s3cret@")
    env = {key: value for key, value in os.environ.items() if key != "SPLITSERVE_REDIS_URL"}
    args = [sys.executable, "-m", "splitserve.cli", "up", "--model", str(tmp_path), "--log-dir",
            str(tmp_path / "logs"), "--workers", "1", "--http-port", str(free_port()), "--grpc-port", str(free_port())]
    if how == "option":
        args += ["--redis-url", url]
    else:
        env["SPLITSERVE_REDIS_URL"] = url
    env["COLUMNS"] = "400"  # one line per message: the URL is not wrapped
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"Redis at {mask_url(url)} does not answer" in output and "s3cret" not in output, output
    assert "[private]" not in output, output
