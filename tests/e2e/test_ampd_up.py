"""AMPD through `splitserve up --workers 3 --prefill-workers 1 --policy ampd` on the real model.

Routing is pinned to remote (`--policy-param routing=remote`), so every round's prefill runs
on the prefill worker and its KV is pushed to the session's decode worker: each round must
still answer exactly what one worker answers for the whole history, the session must stay
on one decode worker, and that worker must keep the history pinned between rounds.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from real_model_support import (FRANCE, chat_prompt_ids, real_model, real_tokenizer,  # noqa: F401 (fixtures)
                                splitserve_up, wait_for_workers)

from splitserve.client import Client
from splitserve.state import StateStore

MAX_TOKENS = 16
FOLLOW_UPS = ["And what is its population?", "Name one famous museum there."]


@pytest.fixture(scope="module")
def llm(real_model):
    from workers.engine import LLM

    return LLM(str(real_model))


@pytest.fixture(scope="module")
def up(real_model, tmp_path_factory):
    with splitserve_up(real_model, tmp_path_factory.mktemp("ampd-up-logs"), "--workers", "3", "--prefill-workers",
                       "1", "--policy", "ampd", "--policy-param", "routing=remote", "--max-num-seqs", "8",
                       "--kv-cache-memory-bytes", str(48 << 20)) as cluster:
        wait_for_workers(cluster["prefix"], 3)
        yield cluster


def _state(up, session_id: str):
    async def read():
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], up["prefix"]) as store:
            return await store.get_session(session_id), await store.get_loads(), await store.list_workers()
    return asyncio.run(read())


def test_remote_incremental_prefills_match_one_worker_and_keep_the_session_bound(up, real_tokenizer, llm):
    from workers.engine import SamplingParams

    turns = [chat_prompt_ids(real_tokenizer, FRANCE)]
    turns += [real_tokenizer.encode(f"\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in FOLLOW_UPS]
    bound_workers = []
    with Client(up["grpc"], timeout_s=300) as client:
        with client.open_session(ttl_s=120) as session:
            history: list[int] = []
            for turn in turns:
                prompt = history + turn
                out = session.generate(turn, max_tokens=MAX_TOKENS, temperature=0)
                expected = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
                assert out.token_ids == expected.token_ids
                history = prompt + out.token_ids
                record, _, workers = _state(up, session.session_id)
                roles = {w.worker_id: w.role for w in workers}
                assert roles[record.decode_worker] == "decode"  # bound to a decode worker, never the prefill one
                # The KV of all but the last sampled token (which the next round computes).
                assert record.history_len == len(history) - 1
                bound_workers.append(record.decode_worker)
            assert len(set(bound_workers)) == 1, bound_workers  # binding: one decode worker for the session
            _, loads, _ = _state(up, session.session_id)
            assert loads[bound_workers[0]].pinned_sessions >= 1
            assert sum(load.session_history_lost for load in loads.values()) == 0
