"""`splitserve chaos`: kill services of a running local cluster on a seeded schedule while the
load generator sends requests whose outputs are known, and report what the clients saw.

Against a cluster started by `splitserve up` (which restarts a service that dies), it:

1. finds the cluster's processes: every service runs ``... splitserve.cli serve <service>
   --redis-prefix <prefix> ...`` (a worker also ``--worker-id <id>``), so the prefix names
   them; only processes of this user are considered;
2. sends each distinct request case once on the quiet cluster: its output is the reference
   (greedy cases and sampled cases with a fixed seed are deterministic, and ``ignore_eos``
   fixes the length);
3. runs open-loop Poisson traffic over those cases with the load generator's runner and,
   meanwhile, a seeded schedule of faults: SIGKILL of a worker (a random live one), of the
   coordinator, or of Redis (restarted by `splitserve up` when it started that Redis itself,
   else by this command); after each fault it waits until the service is back (a new process,
   SERVING, a worker registered again) before the next one, so at most one is down at a time;
4. reports every request as completed at the first try, completed after retries, or
   failed, every completed output that differs from its case's reference (a mismatch:
   corrupted, duplicated or missing tokens), every stream that broke after tokens had
   arrived, the faults with how many requests were running on the victim, and the restarts
   `splitserve up` recorded in Redis — as a rich table and JSON.

Bounds: at most ``worker_kills + coordinator_kills + redis_kills`` faults, traffic for
``duration_s``, then at most ``drain_timeout_s`` for the requests still running; every
attempt has its own deadline (``attempt_timeout_s``: a hang is a DEADLINE_EXCEEDED), and a
request has at most ``max_attempts``. Traffic goes to 127.0.0.1 only: a gateway or Redis
address that is not a loopback address is refused.

Killing Redis is refused unless every key in it belongs to this cluster's prefix (a Redis
shared with other clusters or other people is not this command's to kill).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

import numpy as np
import typer

from loadgen.arrivals import PoissonArrivals
from loadgen.plan import BenchRequest, StreamedResult
from loadgen.runner import RunProgress, run_benchmark
from loadgen.targets import synthetic_text, target_tls

if TYPE_CHECKING:  # splitserve.tls imports grpc; `splitserve simulate` mounts this module without it
    from splitserve.tls import ClientTls

__all__ = ["ChaosError", "ChaosOptions", "ChaosCase", "ChaosReport", "FaultRecord", "RequestOutcome",
           "ServiceProcess", "find_service_processes", "plan_faults", "run_chaos", "render_report",
           "chaos_command", "FAULT_KINDS"]

WORKER, COORDINATOR, REDIS = "worker", "coordinator", "redis"
FAULT_KINDS = (WORKER, COORDINATOR, REDIS)
# Retried by the chaos client, as a careful client would: the service is momentarily gone or
# overloaded, or one attempt hung past its own deadline. Anything else fails the request.
DEFAULT_RETRIABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED")
_POLL_S = 0.1


class ChaosError(RuntimeError):
    """The chaos run cannot start or go on (bad options, the cluster not found or not healthy)."""


@dataclass(frozen=True)
class ChaosOptions:
    """One chaos run. Times are seconds; counts bound the run."""

    target: str = "127.0.0.1:50051"  # the gateway's gRPC address (loopback only)
    redis_url: str = "redis://127.0.0.1:6379/0"  # the cluster's Redis (loopback only)
    redis_prefix: str = "ss:"  # the cluster's prefix: it names the cluster's processes
    seed: int = 0
    duration_s: float = 60.0  # traffic and faults; faults fall in [warmup_s, duration_s - settle_s]
    warmup_s: float = 3.0
    settle_s: float = 5.0
    worker_kills: int = 3
    coordinator_kills: int = 0
    redis_kills: int = 0
    rate: float = 4.0  # requests per second (Poisson)
    max_concurrency: int = 64  # requests in flight at most (later arrivals wait)
    cases: int = 12  # distinct (prompt, sampling) cases; every request repeats one of them
    sampled_fraction: float = 0.5  # the share of cases sampled with a fixed seed (the rest greedy)
    temperature: float = 0.8
    prompt_words: tuple[int, int] = (4, 24)
    max_tokens: tuple[int, int] = (16, 48)
    max_attempts: int = 6
    attempt_timeout_s: float = 60.0
    backoff_s: float = 0.25  # before retry n: backoff_s * 2**(n-1), at most 4 s (or the server's Retry-After)
    retriable: tuple[str, ...] = DEFAULT_RETRIABLE
    recovery_timeout_s: float = 90.0  # a killed service must be back within this
    min_live_workers: int = 1  # a worker is killed only while more than this many others are up
    drain_timeout_s: float = 120.0  # after the traffic, the longest wait for requests still running
    api_key: str | None = None
    gateway_tls: ClientTls | None = None  # TLS to the gateway (None: plaintext)
    internal_tls: ClientTls | None = None  # mTLS to the internal services' health checks (None: plaintext)

    def __post_init__(self) -> None:
        _require_loopback("target", f"//{self.target}" if "://" not in self.target else self.target)
        _require_loopback("redis_url", self.redis_url)
        if not self.redis_prefix:
            raise ValueError("redis_prefix: must not be empty (it names the cluster's processes)")
        for name in ("worker_kills", "coordinator_kills", "redis_kills"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("duration_s", "rate", "attempt_timeout_s", "recovery_timeout_s", "drain_timeout_s",
                     "temperature", "backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.warmup_s < 0 or self.settle_s < 0 or self.warmup_s + self.settle_s >= self.duration_s:
            raise ValueError(f"warmup_s ({self.warmup_s}) + settle_s ({self.settle_s}) must be >= 0 and leave "
                             f"time for faults within duration_s ({self.duration_s})")
        if self.min_live_workers < 0:
            raise ValueError(f"min_live_workers: must be >= 0, got {self.min_live_workers}")
        for name in ("max_concurrency", "cases", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.sampled_fraction <= 1:
            raise ValueError(f"sampled_fraction: must be in [0, 1], got {self.sampled_fraction}")
        for name in ("prompt_words", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max, got ({lo}, {hi})")
        unknown = [code for code in self.retriable if code not in _status_names()]
        if unknown:
            raise ValueError(f"retriable: unknown gRPC status {unknown[0]!r}")

    @property
    def faults(self) -> int:
        return self.worker_kills + self.coordinator_kills + self.redis_kills


def _require_loopback(name: str, url: str) -> None:
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"{name}: chaos sends traffic to this machine's loopback only (127.0.0.1, ::1, "
                         f"localhost); got host {host!r}")


def _status_names() -> frozenset[str]:
    import grpc  # here, not at import: `splitserve simulate` (same CLI) must run without grpc

    return frozenset(code.name for code in grpc.StatusCode)


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


def _kill_service(victim: ServiceProcess, prefix: str) -> None:
    """SIGKILL the victim, after checking its pid still runs the same service (pids are reused)."""
    again = parse_service_cmdline(victim.pid, _cmdline(victim.pid), prefix)
    if again is None or again.name != victim.name:
        raise ProcessLookupError(f"{victim.name} (pid {victim.pid}) is gone")
    os.kill(victim.pid, signal.SIGKILL)


def _grpc_serving(port: int | None, tls: ClientTls | None = None) -> bool:
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


def _redis_client(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def _redis_process(url: str, prefix: str) -> RedisProcess:
    """Find the cluster's redis-server; ChaosError when it is not this cluster's alone to kill."""
    import redis

    client = _redis_client(url)
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


def _redis_answers(url: str) -> bool:
    import redis

    client = _redis_client(url)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


# ---- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosCase:
    """A distinct request: every request of the run repeats one case, so all its outputs must be equal."""

    key: str
    prompt: str
    max_tokens: int
    temperature: float  # 0: greedy
    seed: int | None  # the sampled cases' fixed seed


def make_cases(options: ChaosOptions, rng: np.random.Generator) -> list[ChaosCase]:
    """The run's distinct cases: seeded prompts of random common words, greedy or seeded sampled."""
    sampled = round(options.cases * options.sampled_fraction)
    cases = []
    for i in range(options.cases):
        words = int(rng.integers(options.prompt_words[0], options.prompt_words[1] + 1))
        prompt = f"case {i}: " + synthetic_text(rng.integers(0, 1 << 16, size=words).tolist())
        max_tokens = int(rng.integers(options.max_tokens[0], options.max_tokens[1] + 1))
        is_sampled = i < sampled
        cases.append(ChaosCase(f"c{i}-{'sampled' if is_sampled else 'greedy'}", prompt, max_tokens,
                               options.temperature if is_sampled else 0.0,
                               int(rng.integers(0, 1 << 31)) if is_sampled else None))
    return cases


@dataclass
class AttemptError:
    """One failed attempt of a request."""

    attempt: int
    code: str
    message: str
    at_s: float
    tokens_before: int  # tokens the attempt had streamed before it failed (> 0: a broken stream)


@dataclass
class RequestOutcome:
    """What one request went through."""

    request_id: str
    case: str
    arrival_s: float
    end_s: float = 0.0
    attempts: int = 0
    completed: bool = False
    matches: bool | None = None  # None: not completed or no reference
    mismatch: str | None = None  # what differs
    errors: list[AttemptError] = field(default_factory=list)

    @property
    def retried(self) -> bool:
        return self.attempts > 1


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"{len(got)} tokens vs {len(want)} expected; first difference at position {at}: "
            f"got {list(got[at:at + 4])}, expected {list(want[at:at + 4])}")


class ChaosTarget:
    """A loadgen target over the gateway's gRPC API that retries retriable failures (each
    attempt a new request id) and checks each output against its case's reference."""

    kind = "grpc-chaos"

    def __init__(self, options: ChaosOptions, cases: Sequence[ChaosCase]):
        self.options = options
        self.cases = {case.key: case for case in cases}
        self.case_of: dict[str, str] = {}  # request id -> case key
        self.references: dict[str, list[int]] = {}
        self.outcomes: list[RequestOutcome] = []
        self.origin_s = time.perf_counter()
        self._client: Any = None

    def now(self) -> float:
        return time.perf_counter() - self.origin_s

    def _sdk(self):
        if self._client is None:
            from splitserve.client import AsyncClient

            # Retries are this target's, counted; the SDK's own are off.
            tls = self.options.gateway_tls.sdk_options() if self.options.gateway_tls else {}
            self._client = AsyncClient(self.options.target, api_key=self.options.api_key, max_retries=0, **tls)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def generate(self, request_id: str, case: ChaosCase) -> tuple[RequestOutcome, list[int] | None]:
        """Run one request of `case` to completion or to its last attempt."""
        from splitserve.client import RateLimitedError, SplitserveClientError

        outcome = RequestOutcome(request_id, case.key, self.now())
        tokens: list[int] | None = None
        reference = self.references.get(case.key)
        try:
            for attempt in range(1, self.options.max_attempts + 1):
                outcome.attempts = attempt
                got: list[int] = []
                try:
                    stream = self._sdk().stream(
                        case.prompt, max_tokens=case.max_tokens, temperature=case.temperature, seed=case.seed,
                        ignore_eos=True, request_id=f"{request_id}.a{attempt}",
                        timeout_s=self.options.attempt_timeout_s)
                    async for chunk in stream:
                        got.extend(chunk.token_ids)
                    tokens = got
                    break
                except RateLimitedError as err:
                    code, retry_after, message = err.code.name, err.retry_after_s, err.message
                except SplitserveClientError as err:
                    code, retry_after, message = err.code.name, None, err.message
                except Exception as err:  # noqa: BLE001 -- a client-side failure is recorded, not raised
                    code, retry_after, message = "CLIENT_ERROR", None, f"{type(err).__name__}: {err}"
                outcome.errors.append(AttemptError(attempt, code, message[:300], round(self.now(), 3), len(got)))
                if got and reference is not None and got != reference[:len(got)]:
                    # Tokens that reached the client before the break are already wrong.
                    outcome.mismatch = f"attempt {attempt} streamed wrong tokens before failing: " + \
                        _first_difference(got, reference[:len(got)])
                if code not in self.options.retriable or attempt == self.options.max_attempts:
                    break
                backoff = min(self.options.backoff_s * 2 ** (attempt - 1), 4.0)
                # The server's Retry-After when it gave one (overload), else exponential backoff.
                await asyncio.sleep(min(retry_after, 10.0) if retry_after else backoff)
        except asyncio.CancelledError:
            outcome.errors.append(AttemptError(outcome.attempts, "CUT_OFF", "cut off at the run's time limit",
                                               round(self.now(), 3), 0))
            tokens = None
        outcome.end_s = self.now()
        outcome.completed = tokens is not None
        if tokens is not None and reference is not None:
            outcome.matches = tokens == reference and outcome.mismatch is None
            if tokens != reference:
                outcome.mismatch = _first_difference(tokens, reference)
        elif tokens is not None and len(tokens) != case.max_tokens:
            outcome.mismatch = f"{len(tokens)} tokens, expected {case.max_tokens} (ignore_eos)"
        return outcome, tokens

    async def send(self, request: BenchRequest) -> StreamedResult:
        """The loadgen Target interface: one request of the case its id was planned with."""
        case = self.cases[self.case_of[request.request_id]]
        outcome, tokens = await self.generate(request.request_id, case)
        self.outcomes.append(outcome)
        ok = outcome.completed and outcome.mismatch is None
        error = None if ok else (outcome.mismatch or (outcome.errors[-1].code if outcome.errors else "failed"))
        return StreamedResult(request.request_id, None, 0, outcome.arrival_s, None, [], outcome.end_s, 0,
                              len(tokens or ()), ok, error, list(tokens or ()))


# ---- faults ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    at_s: float
    kind: str  # worker | coordinator | redis


def plan_faults(options: ChaosOptions, rng: np.random.Generator) -> list[PlannedFault]:
    """The seeded schedule: each fault at a uniform time in [warmup_s, duration_s - settle_s], in order."""
    kinds = [WORKER] * options.worker_kills + [COORDINATOR] * options.coordinator_kills + \
        [REDIS] * options.redis_kills
    rng.shuffle(kinds)
    times = np.sort(rng.uniform(options.warmup_s, options.duration_s - options.settle_s, size=len(kinds)))
    return [PlannedFault(round(float(t), 3), kind) for t, kind in zip(times, kinds)]


@dataclass
class FaultRecord:
    """One fault as it happened."""

    kind: str
    planned_at_s: float
    at_s: float | None = None  # when the kill happened (None: not done)
    victim: str = ""
    pid: int | None = None
    running_on_victim: int | None = None  # a worker's running requests just before (its published load)
    requests_in_flight: int = 0  # the run's requests in flight at the kill
    recovered: bool = False
    recovered_after_s: float | None = None
    new_pid: int | None = None
    error: str | None = None  # why it was not done or did not recover


class _Faults:
    """Runs the fault schedule against the cluster (blocking steps in threads)."""

    def __init__(self, options: ChaosOptions, rng: np.random.Generator, clock: Callable[[], float],
                 progress: Callable[[], RunProgress | None], log: Callable[[str], None]):
        self.options = options
        self.rng = rng
        self.clock = clock
        self.progress = progress
        self.log = log
        self.records: list[FaultRecord] = []
        self.spawned_redis: list[int] = []
        self.down: set[str] = set()  # services killed and not yet back

    async def run(self, plan: Sequence[PlannedFault]) -> None:
        """Each fault at its planned time, or as soon after as it is allowed (see `_allowed`); the
        recoveries are watched concurrently, and this returns once every killed service is back
        or timed out."""
        self.records = [FaultRecord(f.kind, f.at_s) for f in plan]
        watchers: list[asyncio.Task] = []
        try:
            for planned, record in zip(plan, self.records):
                if self.clock() < planned.at_s:
                    await asyncio.sleep(planned.at_s - self.clock())
                while not await self._allowed(record.kind) and self.clock() <= self.options.duration_s:
                    await asyncio.sleep(_POLL_S)  # waiting for earlier faults to recover, bounded by the run
                if self.clock() > self.options.duration_s:
                    record.error = ("skipped: no time left in the run (earlier faults were still recovering: "
                                    + ", ".join(sorted(self.down)) + ")")
                    continue
                watcher = await self._one(record)
                if watcher is not None:
                    watchers.append(watcher)
        finally:
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _allowed(self, kind: str) -> bool:
        """Worker kills may overlap while another worker stays up (`min_live_workers`); a coordinator or
        Redis fault waits until every earlier fault recovered, and nothing is killed while they are down."""
        if any(name in self.down for name in (COORDINATOR, REDIS)):
            return False
        if kind != WORKER:
            return not self.down
        live = [s for s in await asyncio.to_thread(find_service_processes, self.options.redis_prefix)
                if s.service == WORKER and s.name not in self.down]
        return len(live) > self.options.min_live_workers

    def _watch(self, name: str, record: FaultRecord, wait: Callable[[], None]) -> asyncio.Task:
        """Mark `name` down now (before any later fault is considered) and watch its recovery."""
        self.down.add(name)

        async def watch() -> None:
            try:
                await asyncio.to_thread(wait)
            except Exception as err:  # noqa: BLE001 -- a failed recovery is the fault's result, not a crash
                record.error = f"recovery of {name} failed: {type(err).__name__}: {err}"
                self.log(record.error)
            finally:
                self.down.discard(name)

        return asyncio.create_task(watch())

    async def _one(self, record: FaultRecord) -> asyncio.Task | None:
        """Do one fault; returns the task watching the victim's recovery (None: nothing was killed)."""
        prefix = self.options.redis_prefix
        try:
            if record.kind == REDIS:
                redis_process = await asyncio.to_thread(_redis_process, self.options.redis_url, prefix)
                record.victim, record.pid = "redis", redis_process.pid
                self._mark(record)
                os.kill(redis_process.pid, signal.SIGKILL)
                self.log(f"[{record.at_s:6.1f} s] killed redis (pid {redis_process.pid})")
                return self._watch(REDIS, record, lambda: self._restart_redis(redis_process, record))
            services = await asyncio.to_thread(find_service_processes, prefix)
            candidates = [s for s in services if s.service == record.kind]
            if not candidates:
                raise ChaosError(f"no live {record.kind} process of the cluster with prefix {prefix!r}"
                                 + (" (is the coordinator embedded in the gateway?)"
                                    if record.kind == COORDINATOR else ""))
            candidates = [s for s in candidates if s.name not in self.down]  # not one being restarted
            victim = candidates[int(self.rng.integers(0, len(candidates)))]
            record.victim, record.pid = victim.name, victim.pid
            if victim.service == WORKER:
                record.running_on_victim = await self._running_on(victim.name)
            await asyncio.to_thread(_kill_service, victim, prefix)
            self._mark(record)
            self.log(f"[{record.at_s:6.1f} s] killed {victim.name} (pid {victim.pid}; "
                     f"{record.requests_in_flight} requests in flight"
                     + (f", {record.running_on_victim} running on it)" if record.running_on_victim is not None
                        else ")"))
            return self._watch(victim.name, record, lambda: self._wait_service_back(victim, record))
        except (ChaosError, OSError) as err:
            record.error = str(err)
            self.log(f"fault {record.kind}: {err}")
        return None

    def _mark(self, record: FaultRecord) -> None:
        record.at_s = round(self.clock(), 3)
        progress = self.progress()
        record.requests_in_flight = progress.in_flight if progress is not None else 0

    async def _running_on(self, worker_id: str) -> int | None:
        from splitserve.state import RedisRetryPolicy, StateStore

        try:
            async with StateStore(self.options.redis_url, self.options.redis_prefix,
                                  retry_policy=RedisRetryPolicy(attempts=1)) as store:
                load = (await asyncio.wait_for(store.get_loads(), 2.0)).get(worker_id)
        except Exception:  # noqa: BLE001 -- informational only (e.g. Redis itself is down)
            return None
        return load.running if load is not None else None

    def _wait_service_back(self, victim: ServiceProcess, record: FaultRecord) -> None:
        """Until a new process of the same service runs, is SERVING, and (a worker) is registered again."""
        deadline = time.monotonic() + self.options.recovery_timeout_s
        started = time.monotonic()
        while time.monotonic() < deadline:
            again = [s for s in find_service_processes(self.options.redis_prefix)
                     if s.name == victim.name and s.pid != victim.pid]
            if again and _grpc_serving(again[0].port, self.options.internal_tls) and (
                    victim.service != WORKER or self._registered(victim.name)):
                record.recovered, record.new_pid = True, again[0].pid
                record.recovered_after_s = round(time.monotonic() - started, 2)
                self.log(f"[{self.clock():6.1f} s] {victim.name} is back (pid {again[0].pid}) after "
                         f"{record.recovered_after_s:.1f} s")
                return
            time.sleep(_POLL_S)  # polling for the restart, bounded by the deadline
        record.error = f"{victim.name} not back within {self.options.recovery_timeout_s:g} s"
        self.log(record.error)

    def _registered(self, worker_id: str) -> bool:
        """The worker published its load again (what the scheduler's view reads); runs in a thread."""
        async def read() -> bool:
            from splitserve.state import RedisRetryPolicy, StateStore

            try:
                async with StateStore(self.options.redis_url, self.options.redis_prefix,
                                      retry_policy=RedisRetryPolicy(attempts=1)) as store:
                    return worker_id in await asyncio.wait_for(store.get_loads(), 2.0)
            except Exception:  # noqa: BLE001 -- not yet: Redis may be down too
                return False

        return asyncio.run(read())

    def _restart_redis(self, killed: RedisProcess, record: FaultRecord) -> None:
        started = time.monotonic()
        deadline = started + self.options.recovery_timeout_s
        if killed.supervised:
            self._wait_redis_restarted_by_up(killed, record, started, deadline)
            return
        while not _pid_gone(killed.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # the port is free once the killed process is gone, bounded by the deadline
        process = subprocess.Popen(list(killed.argv), executable=killed.executable, cwd=killed.cwd, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.spawned_redis.append(process.pid)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                record.error = f"the restarted redis-server exited with code {process.returncode}: {killed.argv}"
                self.log(record.error)
                return
            if _redis_answers(self.options.redis_url):
                record.recovered, record.new_pid = True, process.pid
                record.recovered_after_s = round(time.monotonic() - started, 2)
                self.log(f"[{self.clock():6.1f} s] redis restarted by chaos (pid {process.pid}) after "
                         f"{record.recovered_after_s:.2f} s")
                return
            time.sleep(0.02)  # polling the new server, bounded by the deadline
        record.error = f"the restarted redis-server did not answer within {self.options.recovery_timeout_s:g} s"


    def _wait_redis_restarted_by_up(self, killed: RedisProcess, record: FaultRecord, started: float,
                                    deadline: float) -> None:
        """`splitserve up` restarts the private Redis it started: wait for another process to answer."""
        while time.monotonic() < deadline:
            pid = _redis_pid(self.options.redis_url)
            if pid is not None and pid != killed.pid:
                record.recovered, record.new_pid = True, pid
                record.recovered_after_s = round(time.monotonic() - started, 2)
                self.log(f"[{self.clock():6.1f} s] redis restarted by splitserve up (pid {pid}) after "
                         f"{record.recovered_after_s:.2f} s")
                return
            time.sleep(0.02)  # polling for the supervisor's restart, bounded by the deadline
        record.error = f"splitserve up did not restart redis within {self.options.recovery_timeout_s:g} s"
        self.log(record.error)


def _redis_pid(url: str) -> int | None:
    """The process id of the Redis answering at `url` (None: nothing answers)."""
    import redis

    client = _redis_client(url)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


# ---- the run --------------------------------------------------------------------------------


@dataclass
class ChaosReport:
    """What a chaos run did and what the clients saw."""

    options: dict[str, Any]
    started_unix: float
    wall_s: float
    cases: int
    requests: int
    completed: int
    completed_first_try: int
    retried: int  # requests that needed more than one attempt (completed or not)
    completed_after_retry: int
    failed: int
    mismatches: int
    broken_streams: int  # attempts that failed after tokens had reached the client
    attempt_errors: dict[str, int]
    faults: list[FaultRecord]
    restarts_before: dict[str, int] | None  # None: not readable
    restarts_after: dict[str, int] | None
    failures: list[dict[str, Any]]  # failed or mismatched requests, with their attempts
    redis_started_by_chaos: list[int]  # redis-server pids this run started (they outlive it)
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out


async def _restarts(options: ChaosOptions) -> dict[str, int] | None:
    from splitserve.state import RedisRetryPolicy, StateStore

    try:
        async with StateStore(options.redis_url, options.redis_prefix,
                              retry_policy=RedisRetryPolicy(attempts=3)) as store:
            return await asyncio.wait_for(store.get_restarts(), 5.0)
    except Exception:  # noqa: BLE001 -- informational (None: Redis did not answer)
        return None


async def run_chaos_async(options: ChaosOptions, log: Callable[[str], None] = lambda line: None) -> ChaosReport:
    """The whole run: find the cluster, take the references, traffic plus faults, the report."""
    started_unix = time.time()
    wall0 = time.perf_counter()
    services = await asyncio.to_thread(find_service_processes, options.redis_prefix)
    kinds = {s.service for s in services}
    if not services:
        raise ChaosError(f"no service process of a cluster with Redis prefix {options.redis_prefix!r} runs here "
                         f"(started by `splitserve up --redis-prefix ...`?)")
    if options.worker_kills and WORKER not in kinds:
        raise ChaosError("the cluster has no worker process to kill")
    if options.coordinator_kills and COORDINATOR not in kinds:
        raise ChaosError("the cluster has no coordinator process (embedded in the gateway?): "
                         "--coordinator-kills needs `splitserve up --coordinator process`")
    if options.redis_kills:
        await asyncio.to_thread(_redis_process, options.redis_url, options.redis_prefix)  # refuses early
    log(f"cluster {options.redis_prefix!r}: " + ", ".join(f"{s.name} (pid {s.pid})" for s in services))

    rng = np.random.default_rng(options.seed)
    cases = make_cases(options, rng)
    target = ChaosTarget(options, cases)
    restarts_before = await _restarts(options)
    try:
        for case in cases:  # the references, one at a time on the quiet cluster
            outcome, tokens = await target.generate(f"chaos-{options.seed}-ref-{case.key}", case)
            if tokens is None or outcome.mismatch is not None:
                last = outcome.errors[-1] if outcome.errors else None
                raise ChaosError(f"the cluster did not answer case {case.key} before any fault: "
                                 f"{outcome.mismatch or (f'{last.code}: {last.message}' if last else 'no output')}")
            target.references[case.key] = tokens
        log(f"references: {len(cases)} cases ({sum(c.seed is not None for c in cases)} sampled with a fixed seed)")

        n = max(1, round(options.rate * options.duration_s))
        picks = rng.integers(0, len(cases), size=n)
        requests = []
        for i, pick in enumerate(picks):
            request_id = f"chaos-{options.seed}-{i}"
            target.case_of[request_id] = cases[int(pick)].key
            requests.append(BenchRequest(request_id, [], cases[int(pick)].max_tokens))
        offsets = PoissonArrivals(options.rate).offsets(n, rng)
        offsets = offsets[offsets < options.duration_s]
        requests = requests[:len(offsets)]
        plan = plan_faults(options, rng)
        latest: list[RunProgress] = []
        run_t0 = time.perf_counter()
        faults = _Faults(options, rng, lambda: time.perf_counter() - run_t0,
                         lambda: latest[-1] if latest else None, log)

        def on_progress(state: RunProgress) -> None:
            if not latest:
                latest.append(state)

        fault_task = asyncio.create_task(faults.run(plan))
        try:
            await run_benchmark(target, requests, arrival=offsets, max_concurrency=options.max_concurrency,
                                duration_limit_s=options.duration_s + options.drain_timeout_s,
                                progress=on_progress)
        finally:
            if not fault_task.done():
                # Traffic ended (or the run was cut off) before the schedule did: bounded wait for
                # the fault in progress to recover, then stop.
                try:
                    await asyncio.wait_for(asyncio.shield(fault_task), options.recovery_timeout_s)
                except asyncio.TimeoutError:
                    fault_task.cancel()
        if fault_task.done() and not fault_task.cancelled() and fault_task.exception() is not None:
            raise fault_task.exception()
    finally:
        await target.aclose()
    restarts_after = await _restarts(options)
    return _report(options, started_unix, time.perf_counter() - wall0, cases, target.outcomes, faults,
                   restarts_before, restarts_after)


def _report(options: ChaosOptions, started_unix: float, wall_s: float, cases: Sequence[ChaosCase],
            outcomes: Sequence[RequestOutcome], faults: _Faults, restarts_before: dict[str, int] | None,
            restarts_after: dict[str, int] | None) -> ChaosReport:
    completed = [o for o in outcomes if o.completed]
    mismatched = [o for o in outcomes if o.mismatch is not None]
    failed = [o for o in outcomes if not o.completed]
    attempt_errors: dict[str, int] = {}
    for o in outcomes:
        for e in o.errors:
            attempt_errors[e.code] = attempt_errors.get(e.code, 0) + 1
    problems = []
    if failed:
        problems.append(f"{len(failed)} of {len(outcomes)} requests failed")
    if mismatched:
        problems.append(f"{len(mismatched)} requests had output that differs from their case's reference")
    for record in faults.records:
        if record.error is not None:
            problems.append(f"fault {record.kind} at {record.planned_at_s:.1f} s: {record.error}")
    if restarts_after is None:
        problems.append("the restarts `splitserve up` recorded could not be read from Redis at the end")
    for name in {r.victim for r in faults.records if r.recovered and r.kind != REDIS} if restarts_after else ():
        killed = sum(1 for r in faults.records if r.victim == name and r.at_s is not None)
        counted = restarts_after.get(name, 0) - (restarts_before or {}).get(name, 0)
        if counted < killed:
            problems.append(f"{name} was killed {killed} times but `splitserve up` recorded {counted} restarts")
    return ChaosReport(
        options={k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(options).items()
                 if k != "api_key"},
        started_unix=round(started_unix, 3), wall_s=round(wall_s, 2), cases=len(cases), requests=len(outcomes),
        completed=len(completed), completed_first_try=sum(1 for o in completed if not o.retried),
        retried=sum(1 for o in outcomes if o.retried), completed_after_retry=sum(1 for o in completed if o.retried),
        failed=len(failed), mismatches=len(mismatched),
        broken_streams=sum(1 for o in outcomes for e in o.errors if e.tokens_before > 0),
        attempt_errors=dict(sorted(attempt_errors.items())), faults=faults.records,
        restarts_before=restarts_before, restarts_after=restarts_after,
        failures=[dataclasses.asdict(o) for o in outcomes if not o.completed or o.mismatch is not None][:50],
        redis_started_by_chaos=faults.spawned_redis, problems=problems)


def run_chaos(options: ChaosOptions, log: Callable[[str], None] = lambda line: None) -> ChaosReport:
    """Blocking form of :func:`run_chaos_async`."""
    return asyncio.run(run_chaos_async(options, log))


# ---- output -----------------------------------------------------------------------------------


def render_report(report: ChaosReport):
    """The report as rich tables (requests, then faults)."""
    from rich.console import Group
    from rich.table import Table

    requests = Table(title=f"chaos: {report.requests} requests over {len(report.faults)} faults "
                           f"({'OK' if report.ok else 'PROBLEMS'})")
    for column in ("requests", "completed", "1st try", "after retries", "retried", "failed", "mismatches",
                   "broken streams", "attempt errors"):
        requests.add_column(column, justify="right")
    requests.add_row(str(report.requests), str(report.completed), str(report.completed_first_try),
                     str(report.completed_after_retry), str(report.retried), str(report.failed),
                     str(report.mismatches), str(report.broken_streams),
                     ", ".join(f"{k} {v}" for k, v in report.attempt_errors.items()) or "-")
    faults = Table(title="faults")
    for column in ("kind", "planned s", "at s", "victim", "pid", "running on it", "in flight", "back after s",
                   "new pid", "error"):
        faults.add_column(column)
    for f in report.faults:
        faults.add_row(f.kind, f"{f.planned_at_s:.1f}", "-" if f.at_s is None else f"{f.at_s:.1f}", f.victim or "-",
                       str(f.pid or "-"), "-" if f.running_on_victim is None else str(f.running_on_victim),
                       str(f.requests_in_flight), "-" if f.recovered_after_s is None else f"{f.recovered_after_s:.1f}",
                       str(f.new_pid or "-"), f.error or "")
    parts: list[Any] = [requests, faults]
    if report.problems:
        problems = Table(title="problems")
        problems.add_column("problem")
        for problem in report.problems:
            problems.add_row(problem)
        parts.append(problems)
    return Group(*parts)


def _write_json(report: ChaosReport, out: Path | None) -> None:
    text = json.dumps(report.to_json(), indent=2) + "\n"
    if out is None or str(out) == "-":
        print(text, end="")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


# ---- the command (registered by splitserve/cli.py) ------------------------------------------


def _internal_tls(ca_file: str, cert_file: str, key_file: str, server_name: str) -> ClientTls | None:
    """The services' mTLS (the same three files as the cluster's); ValueError naming an option."""
    if not (ca_file or cert_file or key_file):
        if server_name:
            raise ValueError("mtls_server_name: needs --mtls-ca-file, --mtls-cert-file and --mtls-key-file")
        return None
    if not (ca_file and cert_file and key_file):
        missing = next(name for name, value in (("mtls_ca_file", ca_file), ("mtls_cert_file", cert_file),
                                                ("mtls_key_file", key_file)) if not value)
        raise ValueError(f"{missing}: mTLS needs --mtls-ca-file, --mtls-cert-file and --mtls-key-file together")
    from splitserve.tls import ClientTls, channel_credentials

    channel_credentials(ca_file, cert_file, key_file, fields=("mtls_ca_file", "mtls_cert_file", "mtls_key_file"))
    return ClientTls(ca_file, cert_file, key_file, server_name)


def _pair(text: str, name: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(",")
    try:
        values = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"{name}: expected MIN,MAX (integers), got {text!r}") from None
    return values


def chaos_command(
    target: str = typer.Option("127.0.0.1:50051", "--target", help="The gateway's gRPC address (loopback only)."),
    redis_url: str = typer.Option("redis://127.0.0.1:6379/0", "--redis-url", envvar="SPLITSERVE_REDIS_URL",
                                   help="The cluster's Redis (loopback only)."),
    redis_prefix: str = typer.Option("ss:", "--redis-prefix", envvar="SPLITSERVE_REDIS_PREFIX",
                                      help="The cluster's Redis prefix: it names the cluster's processes."),
    seed: int = typer.Option(0, "--seed", help="Seeds the cases, the arrivals and the fault schedule."),
    duration_s: float = typer.Option(60.0, "--duration-s", help="Seconds of traffic; every fault falls within."),
    warmup_s: float = typer.Option(3.0, "--warmup-s", help="No fault before this many seconds of traffic."),
    settle_s: float = typer.Option(5.0, "--settle-s", help="No fault planned in the last this many seconds."),
    worker_kills: int = typer.Option(3, "--worker-kills", help="Workers to SIGKILL (a random live one each time)."),
    coordinator_kills: int = typer.Option(0, "--coordinator-kills", help="Times to SIGKILL the coordinator."),
    redis_kills: int = typer.Option(0, "--redis-kills", help="Times to SIGKILL Redis (restarted by `splitserve up` "
                                     "when it started it, else by this command; refused unless the Redis holds only "
                                     "this cluster's keys)."),
    rate: float = typer.Option(4.0, "--rate", help="Requests per second (Poisson)."),
    cases: int = typer.Option(12, "--cases", help="Distinct requests (half greedy, half sampled with a fixed seed)."),
    max_tokens: str = typer.Option("16,48", "--max-tokens", help="MIN,MAX tokens per case."),
    prompt_words: str = typer.Option("4,24", "--prompt-words", help="MIN,MAX words per prompt."),
    max_attempts: int = typer.Option(6, "--max-attempts", help="Attempts per request (retriable errors only)."),
    attempt_timeout_s: float = typer.Option(60.0, "--attempt-timeout-s", help="Deadline of one attempt."),
    recovery_timeout_s: float = typer.Option(90.0, "--recovery-timeout-s",
                                              help="A killed service must be back within this."),
    min_live_workers: int = typer.Option(1, "--min-live-workers",
                                         help="Kill a worker only while more than this many others are up."),
    drain_timeout_s: float = typer.Option(120.0, "--drain-timeout-s",
                                           help="After the traffic, the longest wait for requests still running."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPLITSERVE_API_KEY",
                                           help="API key for the gateway."),
    tls: bool = typer.Option(False, "--tls/--no-tls", envvar="SPLITSERVE_TLS", show_envvar=True,
                             help="TLS to the gateway (implied by any --tls-* option)."),
    tls_ca_file: str = typer.Option("", "--tls-ca-file", envvar="SPLITSERVE_TLS_CA_FILE", show_envvar=True,
                                    help="The CA (PEM) that signed the gateway's certificate."),
    tls_cert_file: str = typer.Option("", "--tls-cert-file", envvar="SPLITSERVE_TLS_CLIENT_CERT_FILE",
                                      show_envvar=True, help="A client certificate (PEM) for the gateway."),
    tls_key_file: str = typer.Option("", "--tls-key-file", envvar="SPLITSERVE_TLS_CLIENT_KEY_FILE",
                                     show_envvar=True, help="The private key (PEM) of --tls-cert-file."),
    tls_server_name: str = typer.Option("", "--tls-server-name", envvar="SPLITSERVE_TLS_SERVER_NAME",
                                        show_envvar=True, help="Check the gateway's certificate against this name."),
    mtls_ca_file: str = typer.Option("", "--mtls-ca-file", envvar="SPLITSERVE_MTLS_CA_FILE", show_envvar=True,
                                     help="The cluster's mTLS CA: health checks of restarted services dial with it."),
    mtls_cert_file: str = typer.Option("", "--mtls-cert-file", envvar="SPLITSERVE_MTLS_CERT_FILE",
                                       show_envvar=True, help="mTLS: the certificate presented to the services."),
    mtls_key_file: str = typer.Option("", "--mtls-key-file", envvar="SPLITSERVE_MTLS_KEY_FILE", show_envvar=True,
                                      help="mTLS: the private key of --mtls-cert-file."),
    mtls_server_name: str = typer.Option("", "--mtls-server-name", envvar="SPLITSERVE_MTLS_SERVER_NAME",
                                         show_envvar=True, help="mTLS: the name services' certificates are "
                                         "checked against."),
    out: Path = typer.Option(Path(".splitserve/chaos-report.json"), "--out", help="JSON report ('-': stdout)."),
) -> None:
    """Kill workers (and optionally the coordinator and Redis) of a running `splitserve up` cluster on a
    seeded schedule while requests with known outputs run; report completed, retried, failed, mismatched."""
    import typer
    from rich.console import Console

    console = Console(stderr=str(out) == "-")
    try:
        options = ChaosOptions(
            target=target, redis_url=redis_url, redis_prefix=redis_prefix, seed=seed, duration_s=duration_s,
            warmup_s=warmup_s, settle_s=settle_s,
            worker_kills=worker_kills, coordinator_kills=coordinator_kills, redis_kills=redis_kills, rate=rate,
            cases=cases, max_tokens=_pair(max_tokens, "--max-tokens"),
            prompt_words=_pair(prompt_words, "--prompt-words"), max_attempts=max_attempts,
            attempt_timeout_s=attempt_timeout_s, recovery_timeout_s=recovery_timeout_s,
            min_live_workers=min_live_workers, drain_timeout_s=drain_timeout_s, api_key=api_key,
            gateway_tls=target_tls(tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name),
            internal_tls=_internal_tls(mtls_ca_file, mtls_cert_file, mtls_key_file, mtls_server_name))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    try:
        report = run_chaos(options, log=lambda line: console.print(line, highlight=False))
    except ChaosError as err:
        console.print(f"[red]chaos: {err}[/red]")
        raise typer.Exit(2)
    console.print(render_report(report))
    _write_json(report, out)
    if str(out) != "-":
        console.print(f"JSON report: {out}")
    if report.redis_started_by_chaos:
        console.print(f"redis-server restarted by chaos (pids {report.redis_started_by_chaos}) keeps running for the "
                      f"cluster; `splitserve up` does not stop it")
    if not report.ok:
        raise typer.Exit(1)
