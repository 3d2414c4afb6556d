"""`splitserve up --workers 3 --prefill-workers 2 --policy laps` on the real model (SmolLM2-135M-Instruct).

LAPS' spatial mode (issue 14): the scheduler's pool controller (Alg. 2, the one holding the
Redis leader lock) splits the two prefill workers into a short and a long pool through
`Worker.SetRole`; the `laps` placement policy routes each prompt by L_m (here fixed at 64
tokens, so that chat prompts of this small model fall on both sides) and decodes on the
decode worker. Whatever pool a request runs in, and even when its prefill worker is moved
to the other pool while the request runs, the answer must be the one a single worker
gives: greedy and seeded sampling, through the OpenAI HTTP API and the gRPC SDK.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import grpc
import pytest
from real_model_support import (FRANCE, PHOTOSYNTHESIS, chat_prompt_ids, real_model,  # noqa: F401 (fixtures)
                                real_tokenizer, splitserve_up, wait_for_workers, engine_reference, finished_record,
                                send_chat_cases)

from splitserve.client import Client
from splitserve.proto import worker_pb2, worker_pb2_grpc
from splitserve.state.store import StateStore

MAX_TOKENS = 24
BOUNDARY = 64  # L_m for this test: the short chats below are under it, the long ones over it
LONG_TEXT = ("The history of bread begins with wild grains ground between stones and baked on hot rocks; "
             "over thousands of years bakers learned to keep a sourdough culture, to mill finer flour, "
             "and to build ovens that hold their heat. ")
CHATS = [
    FRANCE,
    [{"role": "user", "content": "Write one sentence about the sea."}],
    PHOTOSYNTHESIS,
    [{"role": "user", "content": LONG_TEXT + "Summarise this in one sentence."}],
    [{"role": "user", "content": LONG_TEXT * 2 + "What is a sourdough culture?"}],
]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=11)]


@pytest.fixture(scope="module")
def up(real_model, tmp_path_factory):
    with splitserve_up(real_model, tmp_path_factory.mktemp("laps-up-logs"), "--workers", "3",
                       "--prefill-workers", "2", "--policy", "laps", "--batch-policy", "laps",
                       "--policy-param", f"boundary_tokens={BOUNDARY}", "--policy-param", "period_s=0.2",
                       "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(48 << 20)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(real_model, real_tokenizer):
    return engine_reference(real_model, real_tokenizer, CHATS, SAMPLING, MAX_TOKENS)


def _loads(prefix: str):
    async def read():
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], prefix) as store:
            return await store.get_loads()
    return asyncio.run(read())


def _pools(up, timeout_s: float = 30.0) -> dict[str, str]:
    """The prefill workers' pools once the controller has assigned both (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = {w: load.pool for w, load in _loads(up["prefix"]).items() if load.role == "prefill"}
        if sorted(pools.values()) == ["long", "short"]:
            return pools
        assert time.monotonic() < deadline, f"the pool controller never split the prefill workers: {pools}"
        time.sleep(0.05)  # polling Redis, bounded by the deadline


def _worker_address(up, worker_id: str) -> str:
    async def read():
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], up["prefix"]) as store:
            return {w.worker_id: w.address for w in await store.list_workers()}[worker_id]
    return asyncio.run(read())


def test_laps_up_routes_by_length_to_two_pools_and_answers_exactly_as_one_worker(up, real_tokenizer, reference):
    wait_for_workers(up["prefix"], 3)
    pools = _pools(up)
    by_pool = {pool: worker for worker, pool in pools.items()}
    lengths = [len(chat_prompt_ids(real_tokenizer, chat)) for chat in CHATS]
    assert min(lengths) < BOUNDARY < max(lengths), lengths  # both classes, or the test means nothing
    http_results, sdk_results = send_chat_cases(up, real_tokenizer, CHATS, SAMPLING, MAX_TOKENS, "laps")

    for (chat, sampling), text, finish in http_results:
        expected = reference[sampling][chat]
        assert text == expected.text, (chat, SAMPLING[sampling])
        assert finish == expected.finish_reason
    for (chat, sampling), request_id, token_ids in sdk_results:
        assert token_ids == reference[sampling][chat].token_ids, (chat, SAMPLING[sampling])
        record = finished_record(up["prefix"], request_id)
        assert record is not None and record.state in ("stop", "length"), record
        short = lengths[chat] < BOUNDARY
        assert record.decision["short"] == (1.0 if short else 0.0) and record.decision["l_m"] == BOUNDARY
        prefill_worker = record.stages[0]["worker_id"]
        if not record.decision.get("overflow"):
            assert prefill_worker == by_pool["short" if short else "long"], (chat, record.stages)
        assert record.stages[-1]["worker_id"] == "worker-2"  # the decode worker


def test_moving_a_prefill_worker_to_the_other_pool_mid_request_loses_nothing(up, real_tokenizer, reference):
    wait_for_workers(up["prefix"], 3)
    short_worker = {pool: worker for worker, pool in _pools(up).items()}["short"]
    address = _worker_address(up, short_worker)
    chat = 0  # short: its prefill runs on the short worker
    request_id = f"laps-move-{uuid.uuid4().hex[:6]}"
    tokens: list[int] = []
    with Client(up["grpc"], timeout_s=300) as client, grpc.insecure_channel(address) as channel:
        stream = client.stream(chat_prompt_ids(real_tokenizer, CHATS[chat]), max_tokens=MAX_TOKENS,
                               request_id=request_id, temperature=0.0)
        moved = None
        for chunk in stream:
            tokens.extend(chunk.token_ids)
            if moved is None:  # an operator's move (no fencing token) while the request runs
                moved = worker_pb2_grpc.WorkerStub(channel).SetRole(
                    worker_pb2.SetRoleRequest(role="prefill", pool="long"), timeout=5)
        assert moved is not None and moved.previous_pool == "short" and moved.pool == "long"
    assert tokens == reference[0][chat].token_ids
    record = finished_record(up["prefix"], request_id)
    assert record.state in ("stop", "length") and len(record.stages) == 2
    # Both prefill workers in the long pool leaves the short one below n_min: the controller
    # refills it at once (with its fencing token), whichever instance it picks.
    assert sorted(_pools(up).values()) == ["long", "short"]


def test_status_shows_each_workers_pool_and_l_m(up):
    wait_for_workers(up["prefix"], 3)
    pools = _pools(up)
    shown = subprocess.run([sys.executable, "-m", "splitserve.cli", "status", "--redis-url",
                            os.environ["SPLITSERVE_TEST_REDIS_URL"], "--redis-prefix", up["prefix"]],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    rows = {line.split("│")[1].strip(): line for line in shown.stdout.splitlines() if "worker-" in line}
    for worker_id, pool in pools.items():
        assert f" {pool} " in rows[worker_id]
    # The workers' laps batch policy has no perf model here: L_m is its fixed default (256).
    assert all(" 256 " in row for row in rows.values()), shown.stdout


def test_a_set_role_with_a_stale_fencing_token_is_refused(up):
    wait_for_workers(up["prefix"], 3)
    worker_id, pool = next(iter(_pools(up).items()))
    with grpc.insecure_channel(_worker_address(up, worker_id)) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        # A far newer leader's token (they start from Redis' clock in ms) is accepted (same pool: no move) ...
        stub.SetRole(worker_pb2.SetRoleRequest(role="prefill", pool=pool, fencing_token=1 << 62), timeout=5)
        # ... after which an older one is refused, naming the field.
        with pytest.raises(grpc.RpcError) as refused:
            stub.SetRole(worker_pb2.SetRoleRequest(role="prefill", pool=pool, fencing_token=1), timeout=5)
        assert refused.value.code() == grpc.StatusCode.ABORTED and "fencing_token" in refused.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            stub.SetRole(worker_pb2.SetRoleRequest(role="prefill", pool="medium"), timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pool" in bad.value.details()
