"""Plain records exchanged with the Redis state store, and their hash encodings.

`splitserve.state.store` re-exports everything public here; import from there.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, get_type_hints

ROLES = ("both", "prefill", "decode")  # a worker's role: which stages placement gives it
# LAPS spatial mode (§3.2): the pool of a prefill worker; "" = in no pool (takes any length).
POOLS = ("", "short", "long")
# Engine kinds of diffusion workers (dLLM-Serve): a diffusion model's requests go only to
# them, whole; an autoregressive model's never do.
DIFFUSION = "diffusion"  # the engine family (RequestMeta.engine_family)
DIFFUSION_ENGINE_KINDS = frozenset({"llada"})


def engine_family(engine_kind: str) -> str:
    """"diffusion" for a diffusion worker's engine kind, "" for an autoregressive one."""
    return DIFFUSION if engine_kind in DIFFUSION_ENGINE_KINDS else ""


@dataclass(frozen=True)
class WorkerInfo:
    """A registered worker: where it listens and what it serves."""

    worker_id: str
    address: str  # host:port of its gRPC server
    role: str = "both"  # "both", "prefill" or "decode"
    engine_kind: str = ""
    model: str = ""
    started_unix: float = field(default_factory=time.time)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load: the one record the engine, the worker service, Redis, the
    scheduler's view and the simulator share (`splitserve.wire` converts it to and from
    the WorkerLoad message). The scheduler core fills the figures; the worker adds its
    identity, role, draining flag and the time it published them."""

    worker_id: str = ""
    role: str = "both"
    engine_kind: str = ""
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    num_preemptions: int = 0
    prefix_hit_rate: float = 0.0
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache since start
    pinned_sessions: int = 0  # sessions whose history KV is pinned here (AMPD binding)
    pinned_blocks: int = 0  # blocks those histories hold (evictable, unlike running requests')
    session_history_lost: int = 0  # rounds since start that expected their history here and recomputed it
    draining: bool = False
    # LAPS spatial mode: the prefill pool new work of one length class is routed to
    # ("short" | "long"; "": none, any class). Set by the pool controller (Worker.SetRole).
    pool: str = ""
    busy_fraction: float = 0.0  # share of the last publish interval the engine spent stepping
    # LAPS' L_m(0) by its local laps batch policy (refitted online from its steps); 0: its
    # policy has none; -1: never compute-bound.
    length_boundary: float = 0.0
    updated_unix: float = 0.0  # when published (unix seconds); 0: not published

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def free_kv_fraction(self) -> float:
        """Free KV blocks / total blocks; 0 when the worker reports no KV cache."""
        if self.total_blocks <= 0:
            return 0.0
        return min(1.0, max(0.0, self.free_blocks / self.total_blocks))


def nearest_rank(ordered: list[float], p: float) -> float:
    """The p-th percentile of sorted, non-empty `ordered` by the nearest-rank method (always a sample)."""
    return ordered[max(1, math.ceil(p / 100.0 * len(ordered))) - 1]


@dataclass(frozen=True)
class LatencyWindow:
    """Summary of the latency samples (seconds) inside a time window."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> LatencyWindow:
        """Summarise values; percentiles use the nearest-rank method (always a sample)."""
        if not values:
            return cls(count=0, mean=0.0, p50=0.0, p90=0.0, p99=0.0, max=0.0)
        ordered = sorted(values)
        n = len(ordered)
        return cls(n, math.fsum(ordered) / n, nearest_rank(ordered, 50), nearest_rank(ordered, 90),
                   nearest_rank(ordered, 99), ordered[-1])


@dataclass(frozen=True)
class PrefillTask:
    """A pending prefill in a worker's queue (AMPD Eq. 1-2 inputs)."""

    task_id: str
    l_hist: int
    l_incr: int
    enq_time: float


@dataclass(frozen=True)
class WorkerActivity:
    """A worker's recent service as Redis holds it: the windowed TTFT and ITL samples and
    its pending prefills (what AMPD's routing reads, §3 and Alg. 1)."""

    ttft: LatencyWindow
    itl: LatencyWindow
    prefill_queue: tuple[PrefillTask, ...] = ()


@dataclass(frozen=True)
class SessionRecord:
    """A multi-turn session bound to the decode worker holding its KV history."""

    session_id: str
    decode_worker: str = ""  # "" until a round has finished somewhere
    history_len: int = 0  # tokens of prompt and output whose KV the decode worker keeps
    last_use: float = field(default_factory=time.time)
    owner: str = ""  # who opened it (a digest of the API key), for the per-owner limit
    ttl_s: float = 600.0  # idle expiry
    busy: str = ""  # the request id of the round in flight, "" when none
    busy_until: float = 0.0  # a crashed coordinator's round stops blocking the session then


@dataclass(frozen=True)
class RequestRecord:
    """A request's progress, enough to migrate it: its stages and tokens emitted so far."""

    request_id: str
    state: str
    stages: list[dict[str, Any]] = field(default_factory=list)
    emitted_token_ids: list[int] = field(default_factory=list)
    updated: float = field(default_factory=time.time)
    # The placement policy's numbers behind its plan (e.g. dynaserve's phi and predicted drain times).
    decision: dict[str, float] = field(default_factory=dict)


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    return get_type_hints(cls)


def to_hash(record: Any) -> dict[str, str]:
    """Flat dataclass -> Redis hash fields (bools as 1/0, floats exactly via repr)."""
    out = {}
    for name, value in asdict(record).items():
        if isinstance(value, bool):
            out[name] = "1" if value else "0"
        elif isinstance(value, float):
            out[name] = repr(value)
        else:
            out[name] = str(value)
    return out


_R = TypeVar("_R")


def from_hash(cls: type[_R], raw: dict[str, str]) -> _R:
    """Redis hash fields -> flat dataclass; unknown fields are ignored, missing ones default."""
    types = _field_types(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in raw:
            continue
        text, kind = raw[f.name], types[f.name]
        values[f.name] = text == "1" if kind is bool else kind(text)
    return cls(**values)


def request_to_hash(request: RequestRecord) -> dict[str, str]:
    """RequestRecord -> hash fields; emitted tokens comma-joined so Lua can append in place."""
    return {
        "request_id": request.request_id,
        "state": request.state,
        "stages": json.dumps(request.stages),
        "emitted": ",".join(str(int(t)) for t in request.emitted_token_ids),
        "num_emitted": str(len(request.emitted_token_ids)),
        "updated": repr(float(request.updated)),
        "decision": json.dumps(request.decision),
    }


def request_from_hash(raw: dict[str, str]) -> RequestRecord:
    """Hash fields written by request_to_hash (and APPEND_EMITTED) -> RequestRecord."""
    emitted = raw.get("emitted", "")
    return RequestRecord(
        request_id=raw["request_id"],
        state=raw["state"],
        stages=json.loads(raw.get("stages") or "[]"),
        emitted_token_ids=[int(t) for t in emitted.split(",")] if emitted else [],
        updated=float(raw.get("updated", 0.0)),
        decision=json.loads(raw.get("decision") or "{}"),
    )
