"""AMPD through `splitserve up --workers 3 --prefill-workers 1 --policy ampd` on the real model.

Routing is pinned to remote (`--policy-param routing=remote`), so every round's prefill runs
on the prefill worker and its KV is pushed to the session's decode worker: each round must
still answer exactly what one worker answers for the whole history, the session must stay
on one decode worker, and that worker must keep the history pinned between rounds. From the
second round on, the prefill worker pulls the pinned history from the decode worker instead
of recomputing it, and only the KV after it goes back (the workers' transfer counters).
"""

from __future__ import annotations

import asyncio
import os
import re

import pytest
from real_model_support import (FRANCE, chat_prompt_ids, real_model, real_tokenizer,  # noqa: F401 (fixtures)
                                splitserve_up, wait_for_workers)

from splitserve.client import Client
from splitserve.state.store import StateStore

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


def _kv_tokens(up, worker_id: str, how: str) -> float:
    """A worker's splitserve_worker_kv_incoming_tokens_total{how} ("pulled", "pushed"), or with
    how="cached" its splitserve_worker_history_cached_tokens_total; its metrics port is in its log."""
    import httpx

    port = re.search(r"metrics on :(\d+)", (up["log_dir"] / f"{worker_id}.log").read_text()).group(1)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    name = "splitserve_worker_history_cached_tokens_total" if how == "cached" else \
        f'splitserve_worker_kv_incoming_tokens_total{{how="{how}"}}'
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_remote_incremental_prefills_match_one_worker_and_keep_the_session_bound(up, real_tokenizer, llm):
    from workers.engine import SamplingParams

    turns = [chat_prompt_ids(real_tokenizer, FRANCE)]
    turns += [real_tokenizer.encode(f"\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in FOLLOW_UPS]
    bound_workers = []
    with Client(up["grpc"], timeout_s=300) as client:
        with client.open_session(ttl_s=120) as session:
            history: list[int] = []
            pulled_in_later_rounds = 0.0
            for round_index, turn in enumerate(turns):
                prompt = history + turn
                _, _, workers = _state(up, session.session_id)
                roles = {w.worker_id: w.role for w in workers}
                prefill_worker = next(w for w, role in roles.items() if role == "prefill")
                pulled = _kv_tokens(up, prefill_worker, "pulled")
                cached = _kv_tokens(up, prefill_worker, "cached")
                pushed = {w: _kv_tokens(up, w, "pushed") for w, role in roles.items() if role == "decode"}
                out = session.generate(turn, max_tokens=MAX_TOKENS, temperature=0)
                expected = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
                assert out.token_ids == expected.token_ids
                record, _, _ = _state(up, session.session_id)
                assert roles[record.decode_worker] == "decode"  # bound to a decode worker, never the prefill one
                pulled_now = _kv_tokens(up, prefill_worker, "pulled") - pulled
                cached_now = _kv_tokens(up, prefill_worker, "cached") - cached
                pushed_now = _kv_tokens(up, record.decode_worker, "pushed") - pushed[record.decode_worker]
                if round_index == 0:
                    assert pulled_now == 0 and pushed_now == len(prompt)  # no history yet: all of it
                else:
                    # The history (whole blocks of it): what the prefill worker computed itself in
                    # earlier rounds from its own cache, the rest (at least the last round's output)
                    # pulled from the decode worker; only the KV after it went back.
                    history_kv = pulled_now + cached_now
                    assert history_kv + pushed_now == len(prompt), (pulled_now, cached_now, pushed_now)
                    assert len(history) - 1 - history_kv < 16  # less than one block (16) of it recomputed
                    pulled_in_later_rounds += pulled_now
                history = prompt + out.token_ids
                # The KV of all but the last sampled token (which the next round computes).
                assert record.history_len == len(history) - 1
                bound_workers.append(record.decode_worker)
            assert len(set(bound_workers)) == 1, bound_workers  # binding: one decode worker for the session
            # The outputs (never computed on the prefill worker) had to come from the decode worker.
            assert pulled_in_later_rounds > 0
            _, loads, _ = _state(up, session.session_id)
            assert loads[bound_workers[0]].pinned_sessions >= 1
            assert sum(load.session_history_lost for load in loads.values()) == 0
