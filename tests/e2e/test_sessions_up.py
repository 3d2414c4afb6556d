"""Sessions (AMPD binding) through `splitserve up --workers 2 --policy session_affinity` on the
real model: each round answers exactly what one worker answers for the whole history, the
later rounds find the history's KV pinned on the session's worker (prefix-hit counters), and
the session API refuses what it must (unknown or closed ids, a second round in flight).
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from real_model_support import (FRANCE, chat_prompt_ids, real_model, real_tokenizer,  # noqa: F401 (fixtures)
                                splitserve_up, wait_for_workers)

from splitserve.client import Client, ConflictError, NotFoundError
from splitserve.state.store import StateStore

MAX_TOKENS = 24
FOLLOW_UPS = ["And what is its population?", "Name one famous museum there."]


@pytest.fixture(scope="module")
def llm(real_model):
    from workers.engine import LLM

    return LLM(str(real_model))


@pytest.fixture(scope="module")
def up(real_model, tmp_path_factory):
    with splitserve_up(real_model, tmp_path_factory.mktemp("sessions-up-logs"), "--workers", "2", "--policy",
                       "session_affinity", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(48 << 20)) as cluster:
        wait_for_workers(cluster["prefix"], 2)
        yield cluster


def _loads(up) -> dict:
    async def read():
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], up["prefix"]) as store:
            return await store.get_loads()
    return asyncio.run(read())


def _hit_tokens(up) -> int:
    return sum(load.prefix_hit_tokens for load in _loads(up).values())


def _wait_published(up, check, timeout_s: float = 10.0):
    """Loads are published every heartbeat: poll until `check(loads)` holds."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        loads = _loads(up)
        if check(loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.05)  # polling the published loads, bounded by the deadline


def test_http_session_rounds_match_one_worker_and_reuse_the_history(up, real_tokenizer, llm):
    from workers.engine import SamplingParams

    with httpx.Client(base_url=up["http"], timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        opened = http.post("/v1/sessions", json={"ttl_s": 120})
        assert opened.status_code == 200, opened.text
        session_id = opened.json()["id"]
        messages = list(FRANCE)
        hits_before = _hit_tokens(up)
        for round_index, follow_up in enumerate([None, *FOLLOW_UPS]):
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
            reply = http.post("/v1/chat/completions", headers={"x-session-id": session_id},
                              json={"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                                    "temperature": 0})
            assert reply.status_code == 200, reply.text
            text = reply.json()["choices"][0]["message"]["content"]
            prompt = chat_prompt_ids(real_tokenizer, messages)
            expected = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
            assert text == expected.text, (round_index, messages)
            messages.append({"role": "assistant", "content": text})
        # The later rounds' prompts start with the earlier ones: at least the first two
        # rounds' prompts were found in the prefix cache, block by block, not recomputed.
        first_two = [chat_prompt_ids(real_tokenizer, messages[:1]), chat_prompt_ids(real_tokenizer, messages[:3])]
        floor = sum(len(p) // 16 * 16 for p in first_two) - 2 * 16
        loads = _wait_published(up, lambda loads: sum(x.prefix_hit_tokens for x in loads.values()) - hits_before
                                >= floor)
        assert sum(x.prefix_hit_tokens for x in loads.values()) - hits_before >= floor
        assert sum(x.session_history_lost for x in loads.values()) == 0
        assert sum(x.pinned_sessions for x in loads.values()) >= 1
        closed = http.delete(f"/v1/sessions/{session_id}")
        assert closed.status_code == 200 and closed.json()["deleted"] is True
        gone = http.post("/v1/chat/completions", headers={"x-session-id": session_id},
                         json={"model": model, "messages": messages, "max_tokens": 4})
        assert gone.status_code == 404, gone.text
        assert gone.json()["error"]["param"] == "session_id"
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 404


def test_sdk_session_carries_token_history_exactly(up, real_tokenizer, llm):
    from workers.engine import SamplingParams

    turns = [chat_prompt_ids(real_tokenizer, FRANCE)]
    turns += [real_tokenizer.encode(f"\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in FOLLOW_UPS]
    with Client(up["grpc"], timeout_s=300) as client:
        with client.open_session(ttl_s=120) as session:
            history: list[int] = []
            floor = 0  # history tokens the later rounds must find cached: all full blocks but the last token's
            hits_before = _hit_tokens(up)
            for turn in turns:
                if history:
                    floor += (len(history) - 1) // 16 * 16
                prompt = history + turn
                out = session.generate(turn, max_tokens=MAX_TOKENS, temperature=0)
                expected = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
                assert out.token_ids == expected.token_ids
                history = prompt + out.token_ids
                assert session.history == history
            # Every later round hit all of its history's full blocks (the history's last token's KV
            # is computed by the round that continues it).
            loads = _wait_published(up, lambda loads: sum(x.prefix_hit_tokens for x in loads.values()) - hits_before
                                    >= floor)
            assert sum(x.prefix_hit_tokens for x in loads.values()) - hits_before >= floor
        with pytest.raises(NotFoundError):
            client.generate(history, max_tokens=4, session_id=session.session_id)  # closed on exit
        with pytest.raises(NotFoundError):
            client.generate([1, 2, 3], max_tokens=4, session_id="never-opened")


def test_a_second_round_in_flight_is_refused(up, real_tokenizer):
    prompt = chat_prompt_ids(real_tokenizer, FRANCE)
    with Client(up["grpc"], timeout_s=300) as client:
        session = client.open_session(ttl_s=60)
        stream = client.stream(prompt, max_tokens=64, ignore_eos=True, temperature=0, session_id=session.session_id)
        first = next(stream)  # the round is running
        assert first.token_ids
        with pytest.raises(ConflictError, match="round in flight"):
            client.generate(prompt, max_tokens=4, session_id=session.session_id)
        rest = list(stream)
        assert rest[-1].finish_reason == "length"
        # Once the round ended, the next one is welcome.
        assert client.generate(prompt, max_tokens=2, session_id=session.session_id).finish_reason == "length"
        assert session.close() and not client.close_session(session.session_id)
