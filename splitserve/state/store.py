"""Live cluster state in Redis. The only module that knows Redis key strings.

Plain dataclasses go in and out (no protobuf; they live in `splitserve.core.records`
and are re-exported here). Every key lives under a configurable prefix (default
``ss:``); `_Keys` builds them all. Read-modify-write operations run as Lua scripts
(`splitserve.state.scripts`) or MULTI transactions, so concurrent writers never see or
leave half-written state.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from dataclasses import asdict
from typing import Any, NamedTuple, Sequence

from splitserve.state import scripts as state_scripts
from splitserve.state.connection import (
    RedisRetryPolicy,
    StateUnavailableError,
    make_client,
    redact_url,
    unavailable_on_connection_error,
    wait_until_reachable,
)
from splitserve.core.records import (
    DIFFUSION,
    POOLS,
    ROLES,
    LatencyWindow,
    PrefillTask,
    WorkerActivity,
    RequestRecord,
    SessionRecord,
    WorkerInfo,
    WorkerLoad,
    from_hash,
    request_from_hash,
    request_to_hash,
    to_hash,
)

__all__ = [
    "BucketTake",
    "DIFFUSION",
    "LATENCY_KINDS",
    "POOLS",
    "ROLES",
    "LatencyWindow",
    "PrefillTask",
    "WorkerActivity",
    "RedisRetryPolicy",
    "RequestRecord",
    "SessionRecord",
    "StateStore",
    "StateUnavailableError",
    "WorkerInfo",
    "WorkerLoad",
]


LATENCY_KINDS = ("ttft", "itl")


class _Keys:
    """Every Redis key splitserve uses, under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def worker_index(self) -> str:
        return f"{self.prefix}workers"

    def restarts(self) -> str:
        """Hash: service name -> times the local supervisor (`splitserve up`) restarted it."""
        return f"{self.prefix}supervisor:restarts"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}worker:{_plain_id(worker_id, 'worker_id')}"

    def worker_load(self, worker_id: str) -> str:
        return f"{self.worker(worker_id)}:load"

    def latency_samples(self, worker_id: str, kind: str) -> str:
        if kind not in LATENCY_KINDS:
            raise ValueError(f"kind must be one of {LATENCY_KINDS}, got {kind!r}")
        return f"{self.worker(worker_id)}:{kind}"

    def prefill_queue(self, worker_id: str) -> str:
        return f"{self.worker(worker_id)}:prefillq"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}session:{_nonempty(session_id, 'session_id')}"

    def sessions_of(self, owner: str) -> str:
        """Open sessions of one owner (sorted set: session id scored by its expiry time)."""
        return f"{self.prefix}sessions_of:{owner or 'anonymous'}"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}req:{_nonempty(request_id, 'request_id')}"

    def perf(self, worker_id: str) -> str:
        return f"{self.prefix}perf:{_plain_id(worker_id, 'worker_id')}"

    def leader(self, name: str) -> str:
        return f"{self.prefix}leader:{_plain_id(name, 'name')}"

    def leader_fence(self, name: str) -> str:
        return f"{self.leader(name)}:fence"

    def nixl(self, worker_id: str) -> str:
        return f"{self.prefix}nixl:{_plain_id(worker_id, 'worker_id')}"

    def rate_limit(self, key: str) -> str:
        return f"{self.prefix}ratelimit:{_nonempty(key, 'key')}"


def _nonempty(value: str, what: str) -> str:
    if not value:
        raise ValueError(f"{what} must be a non-empty string")
    return value


def _plain_id(value: str, what: str) -> str:
    # Worker ids and lock names get key suffixes (":load", ":fence"); a ':' inside the id
    # could make one worker's key collide with another worker's suffixed key.
    if ":" in _nonempty(value, what):
        raise ValueError(f"{what} must not contain ':', got {value!r}")
    return value


def _ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return max(1, math.ceil(ttl_s * 1000))


class StateStore:
    """Async access to splitserve's live state in Redis; use `async with` or `connect()` first."""

    def __init__(
        self,
        redis_url: str,
        prefix: str = "ss:",
        *,
        retry_policy: RedisRetryPolicy | None = None,
        heartbeat_ttl_s: float = 3.0,
        latency_window_s: float = 10.0,
        max_latency_samples: int = 2048,
    ) -> None:
        if max_latency_samples < 1:
            raise ValueError(f"max_latency_samples must be >= 1, got {max_latency_samples}")
        self.url = redact_url(redis_url)
        self.prefix = prefix
        self.retry_policy = retry_policy or RedisRetryPolicy()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.latency_window_s = latency_window_s
        self.max_latency_samples = max_latency_samples
        self._raw_url = redis_url
        self._keys = _Keys(prefix)
        self._redis = make_client(redis_url, self.retry_policy, decode_responses=True)
        # NIXL metadata is opaque bytes; a second client skips utf-8 decoding.
        self._redis_bytes = make_client(redis_url, self.retry_policy, decode_responses=False)
        # Sample members must be unique or equal values recorded at the same time collapse
        # into one zset member; a per-instance tag plus a counter guarantees it.
        self._member_tag = uuid.uuid4().hex[:12]
        self._member_seq = itertools.count()
        self._record_sample = self._redis.register_script(state_scripts.RECORD_SAMPLE)
        self._append_emitted = self._redis.register_script(state_scripts.APPEND_EMITTED)
        self._acquire_leader = self._redis.register_script(state_scripts.ACQUIRE_LEADER)
        self._release_leader = self._redis.register_script(state_scripts.RELEASE_LEADER)
        self._take_tokens = self._redis.register_script(state_scripts.TAKE_TOKENS)
        self._give_back_tokens = self._redis.register_script(state_scripts.GIVE_BACK_TOKENS)
        self._prune_workers = self._redis.register_script(state_scripts.PRUNE_WORKERS)
        self._open_session = self._redis.register_script(state_scripts.OPEN_SESSION)
        self._begin_round = self._redis.register_script(state_scripts.BEGIN_ROUND)
        self._end_round = self._redis.register_script(state_scripts.END_ROUND)
        self._close_session = self._redis.register_script(state_scripts.CLOSE_SESSION)

    def _heartbeat_ms(self, ttl_s: float | None) -> int:
        return _ttl_ms(self.heartbeat_ttl_s if ttl_s is None else ttl_s)

    def _published_ms(self, ttl_s: float | None) -> int:
        # What a worker publishes outlives one missed heartbeat, then disappears with it.
        return _ttl_ms(2 * self.heartbeat_ttl_s if ttl_s is None else ttl_s)

    async def connect(self) -> None:
        """Wait until Redis answers (capped exponential backoff); else StateUnavailableError."""
        await wait_until_reachable(self._raw_url, self.retry_policy)

    async def close(self) -> None:
        """Close both connection pools."""
        await self._redis.aclose()
        await self._redis_bytes.aclose()

    async def __aenter__(self) -> StateStore:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @unavailable_on_connection_error
    async def ping(self) -> bool:
        """True when Redis answers."""
        return bool(await self._redis.ping())

    # ---- worker registry -------------------------------------------------------------

    @unavailable_on_connection_error
    async def register_worker(self, info: WorkerInfo, ttl_s: float | None = None) -> None:
        """Announce a worker; it stays listed while heartbeats arrive within ttl_s."""
        key = self._keys.worker(info.worker_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=to_hash(info))
            pipe.pexpire(key, self._heartbeat_ms(ttl_s))
            pipe.sadd(self._keys.worker_index(), info.worker_id)
            await pipe.execute()

    @unavailable_on_connection_error
    async def heartbeat(self, worker_id: str, ttl_s: float | None = None) -> bool:
        """Extend a worker's registration; False means it expired and must re-register."""
        key = self._keys.worker(worker_id)
        return bool(await self._redis.pexpire(key, self._heartbeat_ms(ttl_s)))

    @unavailable_on_connection_error
    async def deregister_worker(self, worker_id: str) -> bool:
        """Remove a worker and everything it published; False if it was not registered."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._keys.worker(worker_id))
            pipe.delete(
                self._keys.worker_load(worker_id),
                self._keys.prefill_queue(worker_id),
                self._keys.nixl(worker_id),
                *(self._keys.latency_samples(worker_id, kind) for kind in LATENCY_KINDS),
            )
            pipe.srem(self._keys.worker_index(), worker_id)
            existed, *_ = await pipe.execute()
        return bool(existed)

    @unavailable_on_connection_error
    async def list_workers(self) -> list[WorkerInfo]:
        """Live workers (heartbeat not expired), sorted by id."""
        index = self._keys.worker_index()
        worker_ids = sorted(await self._redis.smembers(index))
        rows = await self._hgetall_many([self._keys.worker(w) for w in worker_ids])
        expired = [w for w, row in zip(worker_ids, rows) if not row]
        if expired:
            await self._prune_workers(
                keys=[index, *(self._keys.worker(w) for w in expired)], args=expired
            )
        return [from_hash(WorkerInfo, row) for row in rows if row]

    # ---- the local supervisor ----------------------------------------------------
    @unavailable_on_connection_error
    async def record_restart(self, service: str, restarts: int) -> None:
        """How many times `splitserve up` has restarted `service` (what `splitserve status` shows)."""
        await self._redis.hset(self._keys.restarts(), _nonempty(service, "service"), int(restarts))

    @unavailable_on_connection_error
    async def get_restarts(self) -> dict[str, int]:
        return {name: int(count) for name, count in (await self._redis.hgetall(self._keys.restarts())).items()}

    # ---- load snapshots ------------------------------------------------------------

    @unavailable_on_connection_error
    async def publish_load(self, load: WorkerLoad, ttl_s: float | None = None) -> None:
        """Replace a worker's load snapshot; it expires after ttl_s (default 2x heartbeat TTL)."""
        key = self._keys.worker_load(load.worker_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=to_hash(load))
            pipe.pexpire(key, self._published_ms(ttl_s))
            await pipe.execute()

    @unavailable_on_connection_error
    async def get_loads(self) -> dict[str, WorkerLoad]:
        """Current load snapshots of registered workers, by worker id."""
        worker_ids = sorted(await self._redis.smembers(self._keys.worker_index()))
        rows = await self._hgetall_many([self._keys.worker_load(w) for w in worker_ids])
        return {w: from_hash(WorkerLoad, row) for w, row in zip(worker_ids, rows) if row}

    async def _hgetall_many(self, keys: list[str]) -> list[dict[str, str]]:
        if not keys:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            return await pipe.execute()

    # ---- windowed latency samples ----------------------------------------------------

    async def record_ttft(self, worker_id: str, seconds: float, now: float | None = None) -> int:
        """Record a time-to-first-token sample; returns the samples kept in the window."""
        return await self._record_latency(worker_id, "ttft", seconds, now)

    async def record_itl(self, worker_id: str, seconds: float, now: float | None = None) -> int:
        """Record an inter-token-latency sample; returns the samples kept in the window."""
        return await self._record_latency(worker_id, "itl", seconds, now)

    @unavailable_on_connection_error
    async def _record_latency(
        self, worker_id: str, kind: str, seconds: float, now: float | None
    ) -> int:
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"latency must be a finite number >= 0 s, got {seconds}")
        now = time.time() if now is None else now
        member = f"{seconds!r}|{self._member_tag}:{next(self._member_seq)}"
        # Samples older than one window are useless, so an idle worker's key expires.
        expire_ms = _ttl_ms(self.latency_window_s) + 1000
        count = await self._record_sample(
            keys=[self._keys.latency_samples(worker_id, kind)],
            args=[
                repr(float(now)),
                member,
                repr(float(self.latency_window_s)),
                self.max_latency_samples,
                expire_ms,
            ],
        )
        return int(count)

    @unavailable_on_connection_error
    async def record_latencies(
        self, worker_id: str, ttft: Sequence[float], itl: Sequence[float], now: float | None = None
    ) -> None:
        """Record many TTFT and ITL samples in one round trip (one pipeline of script calls)."""
        samples = [("ttft", s) for s in ttft] + [("itl", s) for s in itl]
        if not samples:
            return
        for _, seconds in samples:
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"latency must be a finite number >= 0 s, got {seconds}")
        now = time.time() if now is None else now
        expire_ms = _ttl_ms(self.latency_window_s) + 1000
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, seconds in samples:
                member = f"{seconds!r}|{self._member_tag}:{next(self._member_seq)}"
                await self._record_sample(
                    keys=[self._keys.latency_samples(worker_id, kind)],
                    args=[repr(float(now)), member, repr(float(self.latency_window_s)),
                          self.max_latency_samples, expire_ms],
                    client=pipe,
                )
            await pipe.execute()

    @unavailable_on_connection_error
    async def window_stats(
        self, worker_id: str, kind: str, now: float | None = None, window_s: float | None = None
    ) -> LatencyWindow:
        """Summary of the `kind` ("ttft" or "itl") samples recorded at or after now - window_s."""
        now = time.time() if now is None else now
        window_s = self.latency_window_s if window_s is None else window_s
        # No upper bound: a worker whose clock runs ahead must not have its fresh samples
        # hidden from a scheduler whose clock runs behind.
        members = await self._redis.zrangebyscore(
            self._keys.latency_samples(worker_id, kind), repr(now - window_s), "+inf"
        )
        return LatencyWindow.of([float(m.split("|", 1)[0]) for m in members])

    @unavailable_on_connection_error
    async def worker_activity(
        self, worker_ids: Sequence[str], now: float | None = None, window_s: float | None = None
    ) -> dict[str, WorkerActivity]:
        """Windowed TTFT/ITL and pending prefills of many workers in one round trip."""
        if not worker_ids:
            return {}
        now = time.time() if now is None else now
        window_s = self.latency_window_s if window_s is None else window_s
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                for kind in LATENCY_KINDS:
                    pipe.zrangebyscore(self._keys.latency_samples(worker_id, kind), repr(now - window_s), "+inf")
                pipe.lrange(self._keys.prefill_queue(worker_id), 0, -1)
            replies = await pipe.execute()
        activity = {}
        for index, worker_id in enumerate(worker_ids):
            ttft, itl, queue = replies[3 * index: 3 * index + 3]
            activity[worker_id] = WorkerActivity(
                LatencyWindow.of([float(m.split("|", 1)[0]) for m in ttft]),
                LatencyWindow.of([float(m.split("|", 1)[0]) for m in itl]),
                tuple(PrefillTask(**json.loads(item)) for item in queue))
        return activity

    # ---- prefill queue metadata ------------------------------------------------------

    @unavailable_on_connection_error
    async def publish_prefill_queue(
        self, worker_id: str, tasks: list[PrefillTask], ttl_s: float | None = None
    ) -> None:
        """Replace a worker's pending-prefill list atomically (expires like its load)."""
        key = self._keys.prefill_queue(worker_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if tasks:
                pipe.rpush(key, *(json.dumps(asdict(t)) for t in tasks))
                pipe.pexpire(key, self._published_ms(ttl_s))
            await pipe.execute()

    @unavailable_on_connection_error
    async def get_prefill_queue(self, worker_id: str) -> list[PrefillTask]:
        """A worker's pending prefills, in queue order."""
        items = await self._redis.lrange(self._keys.prefill_queue(worker_id), 0, -1)
        return [PrefillTask(**json.loads(item)) for item in items]

    # ---- sessions and requests -------------------------------------------------------

    @unavailable_on_connection_error
    async def put_session(self, session: SessionRecord, ttl_s: float) -> None:
        """Write a session record that expires after ttl_s without another put."""
        await self._replace_hash(self._keys.session(session.session_id), to_hash(session), ttl_s)

    @unavailable_on_connection_error
    async def get_session(self, session_id: str) -> SessionRecord | None:
        """The session record, or None when absent or expired."""
        raw = await self._redis.hgetall(self._keys.session(session_id))
        return from_hash(SessionRecord, raw) if raw else None

    @unavailable_on_connection_error
    async def delete_session(self, session_id: str) -> bool:
        """Remove a session record; False if there was none."""
        return bool(await self._redis.delete(self._keys.session(session_id)))

    @unavailable_on_connection_error
    async def open_session(self, session_id: str, owner: str, ttl_s: float, now: float,
                           max_per_owner: int = 0) -> tuple[str, int]:
        """Create a session, or refresh an open one of the same owner, atomically with the
        per-owner limit. Returns (outcome, the owner's open sessions): outcome 'created',
        'refreshed', 'taken' (another owner's id) or 'limit' (max_per_owner reached)."""
        _ttl_ms(ttl_s)
        keys = [self._keys.session(session_id), self._keys.sessions_of(owner)]
        outcome, open_count = await self._open_session(keys=keys, args=[session_id, owner, repr(float(ttl_s)),
                                                                        repr(float(now)), int(max_per_owner)])
        return _text(outcome), int(open_count)

    @unavailable_on_connection_error
    async def begin_session_round(self, session_id: str, request_id: str, now: float,
                                  busy_s: float) -> SessionRecord | str | None:
        """Mark a round of the session in flight: its record; None when the session is not open;
        the other round's request id (a str) when one is in flight."""
        reply = await self._begin_round(keys=[self._keys.session(session_id)],
                                        args=[_nonempty(request_id, "request_id"), repr(float(now)),
                                              repr(float(busy_s))])
        status = _text(reply[0])
        if status == "missing":
            return None
        if status == "busy":
            return _text(reply[1])
        flat = [_text(x) for x in reply[1]]
        return from_hash(SessionRecord, dict(zip(flat[::2], flat[1::2])))

    @unavailable_on_connection_error
    async def end_session_round(self, session: SessionRecord, request_id: str, now: float,
                                decode_worker: str | None, history_len: int | None) -> bool:
        """End the round `request_id` holds: where the history lives now (None: unchanged),
        and restart the idle TTL. False when the session closed or expired meanwhile."""
        keys = [self._keys.session(session.session_id), self._keys.sessions_of(session.owner)]
        done = await self._end_round(keys=keys, args=[request_id, repr(float(now)), decode_worker or "",
                                                      -1 if history_len is None else int(history_len)])
        return bool(done)

    @unavailable_on_connection_error
    async def close_session(self, session_id: str, owner: str | None = None) -> SessionRecord | str | None:
        """Delete a session: its last record fields (owner, decode worker) when closed, None when
        it was not open, 'denied' when `owner` is given and is not the opener."""
        reply = await self._close_session(keys=[self._keys.session(session_id)], args=[owner or ""])
        status = _text(reply[0])
        if status == "missing":
            return None
        if status == "denied":
            return "denied"
        record = SessionRecord(session_id, decode_worker=_text(reply[2]), owner=_text(reply[1]))
        await self._redis.zrem(self._keys.sessions_of(record.owner), session_id)
        return record

    @unavailable_on_connection_error
    async def put_request(self, request: RequestRecord, ttl_s: float) -> None:
        """Write a request record that expires after ttl_s without another put."""
        key = self._keys.request(request.request_id)
        await self._replace_hash(key, request_to_hash(request), ttl_s)

    @unavailable_on_connection_error
    async def put_requests(self, requests: Sequence[RequestRecord], ttl_s: float) -> None:
        """Write many request records in one MULTI/EXEC (each replaced whole, like put_request)."""
        if not requests:
            return
        async with self._redis.pipeline(transaction=True) as pipe:
            for request in requests:
                key = self._keys.request(request.request_id)
                pipe.delete(key)
                pipe.hset(key, mapping=request_to_hash(request))
                pipe.pexpire(key, _ttl_ms(ttl_s))
            await pipe.execute()

    @unavailable_on_connection_error
    async def append_emitted(
        self, request_id: str, token_ids: list[int], updated: float | None = None
    ) -> int | None:
        """Append emitted tokens atomically; returns the new total, None if the record is gone."""
        total = await self._append_emitted(
            keys=[self._keys.request(request_id)],
            args=[
                ",".join(str(int(t)) for t in token_ids),
                len(token_ids),
                "" if updated is None else repr(float(updated)),
            ],
        )
        return None if int(total) < 0 else int(total)

    @unavailable_on_connection_error
    async def get_request(self, request_id: str) -> RequestRecord | None:
        """The request record, or None when absent or expired."""
        raw = await self._redis.hgetall(self._keys.request(request_id))
        return request_from_hash(raw) if raw else None

    @unavailable_on_connection_error
    async def delete_request(self, request_id: str) -> bool:
        """Remove a request record; False if there was none."""
        return bool(await self._redis.delete(self._keys.request(request_id)))

    async def _replace_hash(self, key: str, mapping: dict[str, str], ttl_s: float) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, _ttl_ms(ttl_s))
            await pipe.execute()

    # ---- performance-model coefficients and NIXL metadata ----------------------------

    @unavailable_on_connection_error
    async def put_perf(self, worker_id: str, coefficients: dict[str, Any]) -> None:
        """Store a worker's fitted performance-model coefficients (JSON-serialisable)."""
        await self._redis.set(self._keys.perf(worker_id), json.dumps(coefficients))

    @unavailable_on_connection_error
    async def get_perf(self, worker_id: str) -> dict[str, Any] | None:
        """A worker's coefficients, or None if never profiled."""
        raw = await self._redis.get(self._keys.perf(worker_id))
        return json.loads(raw) if raw is not None else None

    @unavailable_on_connection_error
    async def put_nixl_metadata(
        self, worker_id: str, metadata: bytes, ttl_s: float | None = None
    ) -> None:
        """Store a worker's NIXL agent metadata (opaque bytes); no expiry unless ttl_s."""
        key = self._keys.nixl(worker_id)
        await self._redis_bytes.set(key, metadata, px=None if ttl_s is None else _ttl_ms(ttl_s))

    @unavailable_on_connection_error
    async def get_nixl_metadata(self, worker_id: str) -> bytes | None:
        """A worker's NIXL agent metadata, or None."""
        return await self._redis_bytes.get(self._keys.nixl(worker_id))

    # ---- leader lock and rate limiting -----------------------------------------------

    @unavailable_on_connection_error
    async def try_acquire_leader(self, name: str, holder: str, ttl_s: float) -> int | None:
        """Acquire or renew lock `name`; returns its fencing token, or None if held by another."""
        token = await self._acquire_leader(
            keys=[self._keys.leader(name), self._keys.leader_fence(name)],
            args=[_nonempty(holder, "holder"), _ttl_ms(ttl_s)],
        )
        return None if token is None else int(token)

    @unavailable_on_connection_error
    async def release_leader(self, name: str, holder: str) -> bool:
        """Release lock `name` if `holder` holds it; False otherwise."""
        return bool(await self._release_leader(keys=[self._keys.leader(name)], args=[holder]))

    @unavailable_on_connection_error
    async def take_tokens(self, takes: Sequence[BucketTake], now: float | None = None) -> tuple[bool, float, int]:
        """Take each bucket's cost, all or nothing, in one script: (allowed, seconds until all
        would pass, index into `takes` of the bucket that refused: the longest wait; -1 when
        allowed). The time is Redis's (`TIME`), one clock for every replica; `now` overrides it
        (tests and replays only)."""
        if not takes:
            raise ValueError("takes: expected at least one bucket")
        args = ["" if now is None else repr(float(now))]
        for take in takes:
            _check_bucket(take.rate_per_s, take.burst, take.cost, "cost")
            args += [repr(float(take.rate_per_s)), repr(float(take.burst)), repr(float(take.cost))]
        allowed, refused, retry_after = await self._take_tokens(
            keys=[self._keys.rate_limit(take.key) for take in takes], args=args)
        return bool(int(allowed)), float(retry_after), int(refused) - 1

    async def take_token(
        self, key: str, rate_per_s: float, burst: float, now: float | None = None, cost: float = 1.0
    ) -> tuple[bool, float]:
        """Take `cost` tokens from bucket `key` (by Redis's clock unless `now` is given); returns
        (allowed, seconds until it would be)."""
        allowed, retry_after, _ = await self.take_tokens([BucketTake(key, rate_per_s, burst, cost)], now)
        return allowed, retry_after

    @unavailable_on_connection_error
    async def give_back_tokens(
        self, key: str, rate_per_s: float, burst: float, amount: float, now: float | None = None
    ) -> float:
        """Return `amount` unused tokens to bucket `key` (never above `burst`); its level after."""
        _check_bucket(rate_per_s, burst, amount, "amount")
        level = await self._give_back_tokens(
            keys=[self._keys.rate_limit(key)],
            args=["" if now is None else repr(float(now)), repr(float(rate_per_s)), repr(float(burst)),
                  repr(float(amount))])
        return float(level)


class BucketTake(NamedTuple):
    """What `StateStore.take_tokens` takes from one token bucket: `cost` of its `burst`,
    which refills at `rate_per_s`."""

    key: str
    rate_per_s: float
    burst: float
    cost: float = 1.0


def _check_bucket(rate_per_s: float, burst: float, amount: float, what: str) -> None:
    if not (rate_per_s > 0 and burst > 0 and 0 < amount <= burst):
        raise ValueError(f"need rate_per_s > 0, burst > 0 and 0 < {what} <= burst; "
                         f"got {rate_per_s}, {burst}, {amount}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
