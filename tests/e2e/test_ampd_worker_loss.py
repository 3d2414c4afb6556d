"""Killing a session's bound decode worker (AMPD, issue 13): the session re-binds and loses nothing.

A cluster of one prefill and three decode workers on the tiny model, policy `ampd`. The
client never retries (`max_retries=0`), so whatever it sees is what the service promises:
- killed between rounds: the next round is placed on the dead worker (still registered until
  its heartbeat expires), fails to reach it, and is placed again without it (`avoid_workers`):
  it answers exactly, re-bound to a live decode worker, the history recomputed there;
- killed while a round streams: the round migrates (the coordinator re-places it without the
  dead worker and recomputes from the tokens already sent) and completes exactly; the session
  moves to the worker that finished it, and the next round continues there.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import uuid

import httpx
import pytest

from splitserve.client import Client
from splitserve.cli.launcher import ClusterSpec, start_cluster
from splitserve.redis_server import free_port
from splitserve.state.store import StateStore
from workers.engine import LLM, SamplingParams

TURNS = [[(i * 53 + 7 * r) % 300 + 1 for i in range(14)] for r in range(4)]
SHORT, LONG = 8, 150


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]), workers=4, prefill_workers=1, policy="ampd",
        http_port=free_port(), grpc_port=free_port(), redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"],
        redis_prefix=f"ss:ampd-loss-{uuid.uuid4().hex[:8]}:", log_dir=tmp_path_factory.mktemp("ampd-loss-logs"),
        worker_args={"kv_cache_memory_bytes": 8 << 20, "max_num_seqs": 16, "block_size": 4},
    )
    running = start_cluster(spec)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["llama"]))


def _expected(llm, prompt: list[int], max_tokens: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))[0].token_ids


def _read(cluster, session_id: str, request_id: str):
    async def read():
        async with StateStore(cluster.redis_url, cluster.redis_prefix) as store:
            return await store.get_session(session_id), await store.get_request(request_id)
    return asyncio.run(read())


def _kill(cluster, worker_id: str) -> None:
    os.killpg(cluster.child(worker_id).process.pid, signal.SIGKILL)
    cluster.child(worker_id).process.wait(timeout=10)


def _migrations(cluster) -> float:
    text = httpx.get(f"http://127.0.0.1:{cluster.child('coordinator').metrics_port}/metrics", timeout=5).text
    match = re.search(r"^splitserve_coordinator_migrations_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_killing_the_bound_decode_worker_rebinds_the_session_and_loses_nothing(cluster, llm):
    dead: set[str] = set()
    with Client(cluster.gateway_grpc, timeout_s=60, max_retries=0) as client:
        session = client.open_session(ttl_s=120)
        history: list[int] = []

        def round_(turn: list[int], request_id: str) -> str:
            nonlocal history
            prompt = history + turn
            out = session.generate(turn, max_tokens=SHORT, ignore_eos=True, temperature=0.0, request_id=request_id)
            assert out.token_ids == _expected(llm, prompt, SHORT)
            history = prompt + out.token_ids
            record, _ = _read(cluster, session.session_id, request_id)
            assert record.history_len == len(history) - 1
            return record.decode_worker

        first = round_(TURNS[0], "loss-1")
        _kill(cluster, first)  # between rounds: the registry still lists it for a few seconds
        dead.add(first)
        second = round_(TURNS[1], "loss-2")
        assert second not in dead
        _, request = _read(cluster, session.session_id, "loss-2")
        assert request.decision.get("rebound") == 1.0 and request.decision.get("history_len") == 0.0

        # Killed while the round streams: it migrates and finishes exactly.
        migrations = _migrations(cluster)
        prompt = history + TURNS[2]
        tokens: list[int] = []
        killed_at = None
        for chunk in client.stream(prompt, max_tokens=LONG, ignore_eos=True, temperature=0.0,
                                   session_id=session.session_id, request_id="loss-3"):
            tokens += chunk.token_ids
            if killed_at is None and len(tokens) >= 10:
                killed_at = len(tokens)
                _kill(cluster, second)
                dead.add(second)
        assert killed_at is not None and killed_at < LONG
        assert tokens == _expected(llm, prompt, LONG)
        assert _migrations(cluster) >= migrations + 1
        history = prompt + tokens
        third, _ = _read(cluster, session.session_id, "loss-3")
        assert third.decode_worker not in dead and third.history_len == len(history) - 1
        session.history = list(history)

        fourth = round_(TURNS[3], "loss-4")
        assert fourth == third.decode_worker  # the session stays where its history now is
        session.close()
