"""Reading a fitted performance model: from a JSON file, or from Redis where `splitserve profile` stored it.

`splitserve simulate --perf-model` reads through here. A JSON file, the usual case, needs
nothing but :mod:`splitserve.perf.model`; only the Redis reader imports
:mod:`splitserve.state.store` (and with it redis), inside the function, so the simulator runs
where redis is not installed.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from splitserve.perf.model import PerfModel

__all__ = ["REDIS_SOURCE_PREFIX", "load_perf_model", "read_stored_perf_model", "resolve_perf_model"]

REDIS_SOURCE_PREFIX = "redis:"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_REDIS_PREFIX = "ss:"


def load_perf_model(source: str, redis_url: str | None = None, redis_prefix: str | None = None) -> PerfModel:
    """A fitted model from a JSON path, or from Redis as ``redis:WORKER_ID`` (what `splitserve profile` stored).

    Redis is `redis_url` with keys under `redis_prefix`; when not given, SPLITSERVE_REDIS_URL
    and SPLITSERVE_REDIS_PREFIX, else the defaults every splitserve service uses.
    """
    if source.startswith(REDIS_SOURCE_PREFIX):
        if redis_url is None:
            redis_url = os.environ.get("SPLITSERVE_REDIS_URL", DEFAULT_REDIS_URL)
        if redis_prefix is None:
            redis_prefix = os.environ.get("SPLITSERVE_REDIS_PREFIX", DEFAULT_REDIS_PREFIX)
        return read_stored_perf_model(source[len(REDIS_SOURCE_PREFIX):], redis_url, redis_prefix)
    return PerfModel.load(source)


def read_stored_perf_model(worker_id: str, redis_url: str, redis_prefix: str) -> PerfModel:
    """The model `splitserve profile` stored in Redis for `worker_id`; ValueError when there is
    none or Redis does not answer (the message names the URL)."""
    from splitserve.state.store import RedisRetryPolicy, StateStore, StateUnavailableError  # redis: only here

    async def read() -> dict[str, Any] | None:
        async with StateStore(redis_url, redis_prefix, retry_policy=RedisRetryPolicy(attempts=2)) as store:
            return await store.get_perf(worker_id)

    try:
        data = asyncio.run(read())
    except StateUnavailableError as err:
        raise ValueError(f"--perf-model redis:{worker_id}: {err}") from None
    if data is None:
        raise ValueError(f"no perf model in Redis for worker {worker_id!r} (prefix {redis_prefix!r})")
    return PerfModel.from_dict(data)


def resolve_perf_model(spec: str) -> PerfModel:
    """A model named the way every `--perf-model`-like option names one: a JSON path,
    `redis:WORKER_ID` (what `splitserve profile` stored), or a preset `[BACKEND:]GPU/MODEL[/TP]`
    (e.g. `A100/qwen2.5-14b/2`, `datasheet:A100/qwen2.5-14b`): BACKEND is `auto` (the default:
    measured GPU data where covered, else the kernel-class roofline), `aiconfigurator`,
    `roofline` or `datasheet` (`splitserve.perf.backends.perf_model_for`). ValueError names what was expected."""
    if spec.startswith(REDIS_SOURCE_PREFIX) or spec.endswith(".json") or os.path.isfile(spec):
        return load_perf_model(spec)
    from splitserve.perf.backends import BACKENDS, perf_model_for

    backend, colon, rest = spec.partition(":")
    if not colon:
        backend, rest = "auto", spec
    parts = rest.split("/")
    if backend not in BACKENDS or len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"perf model: expected a JSON file, redis:WORKER_ID or [BACKEND:]GPU/MODEL[/TP] with BACKEND "
                         f"one of {', '.join(BACKENDS)}, got {spec!r}")
    try:
        tp = int(parts[2]) if len(parts) == 3 else 1
    except ValueError:
        raise ValueError(f"perf model {spec!r}: TP must be an integer, got {parts[2]!r}") from None
    return perf_model_for(parts[0], parts[1], tp, backend=backend)
