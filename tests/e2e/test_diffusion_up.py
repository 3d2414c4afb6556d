"""`splitserve up --model <LLaDA dir>`: a diffusion model served by the whole cluster (issue 15).

The tiny LLaDA trained in the repository (workers/diffusion/tiny_model, digit reversal) on
two diffusion workers: answers through the official `openai` client (the denoising knobs as
extra body fields) and the gRPC SDK must equal the offline diffusion engine's, token for
token, and be right on held-out problems; a stream delivers one chunk per block, each when
it is final; bad knobs get 400s naming the field; the workers register as diffusion workers
and the scheduler spreads requests over them.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from real_model_support import finished_record, splitserve_up, wait_for_workers

from splitserve.client import Client, InvalidRequestError
from splitserve.state.store import StateStore
from workers.diffusion import tiny_task
from workers.diffusion.tiny_task import TINY_MODEL_DIR

openai = pytest.importorskip("openai")

GEN = 16  # tokens generated: the longest answer (12 digits) and EOS
KNOBS = {"steps": 16, "block_length": 4}
PROBLEMS = tiny_task.problems(8, seed=15)  # held out: never seen in training


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    with splitserve_up(TINY_MODEL_DIR, tmp_path_factory.mktemp("diffusion-up-logs"), "--workers", "2") as cluster:
        wait_for_workers(cluster["prefix"], 2)
        yield cluster


@pytest.fixture(scope="module")
def reference():
    """The offline diffusion engine (the one each worker runs) on the same problems."""
    from workers.engine import LLM, SamplingParams

    llm = LLM(str(TINY_MODEL_DIR))
    greedy = llm.generate([list(p.prompt_ids) for p in PROBLEMS],
                          SamplingParams(max_tokens=GEN, temperature=0.0, **KNOBS))
    sampled = llm.generate([list(p.prompt_ids) for p in PROBLEMS],
                           SamplingParams(max_tokens=GEN, temperature=0.0, seed=7, remasking="random", **KNOBS))
    return {"greedy": [o.token_ids for o in greedy], "random": [o.token_ids for o in sampled]}


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up["http"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_workers_register_as_diffusion_workers(up):
    async def read():
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], up["prefix"]) as store:
            return await store.list_workers(), await store.get_loads()

    workers, loads = asyncio.run(read())
    assert len(workers) == 2 and {w.engine_kind for w in workers} == {"llada"}
    assert {load.engine_kind for load in loads.values()} == {"llada"}


def test_openai_client_answers_as_the_offline_engine(client, reference):
    model = _model(client)
    for problem, expected in zip(PROBLEMS, reference["greedy"]):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": problem.prompt_text}], max_tokens=GEN,
            temperature=0.0, extra_body=KNOBS)
        assert reply.choices[0].message.content == tiny_task.decode(expected)
        assert reply.usage.completion_tokens == len(expected)
        assert reply.choices[0].finish_reason == "stop"  # the model ends its answer with EOS
    assert sum(tiny_task.is_correct(ids, p) for ids, p in zip(reference["greedy"], PROBLEMS)) >= 7


def test_random_remasking_with_a_seed_is_reproduced(client, reference):
    model = _model(client)
    for problem, expected in zip(PROBLEMS[:4], reference["random"]):
        reply = client.completions.create(
            model=model, prompt=list(problem.prompt_ids), max_tokens=GEN, temperature=0.0, seed=7,
            extra_body={**KNOBS, "remasking": "random"})
        assert reply.choices[0].text == tiny_task.decode(expected)


def test_stream_delivers_each_block_when_final(client, reference):
    problem, expected = PROBLEMS[0], reference["greedy"][0]
    stream = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": problem.prompt_text}], max_tokens=GEN,
        temperature=0.0, stream=True, extra_body=KNOBS)
    pieces = [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    block = KNOBS["block_length"]
    # Whole blocks of 4 tokens (one byte each), the last cut after its EOS (not shown as text).
    assert pieces == [tiny_task.decode(expected[i:i + block]) for i in range(0, len(expected), block)
                      if tiny_task.decode(expected[i:i + block])]
    assert len(pieces) >= 2


def test_sdk_answers_as_the_offline_engine(up, reference):
    with Client(up["grpc"], timeout_s=60) as sdk:
        for problem, expected in zip(PROBLEMS[:4], reference["greedy"]):
            got = sdk.generate(list(problem.prompt_ids), max_tokens=GEN, temperature=0.0, **KNOBS)
            assert got.token_ids == expected
            chunks = list(sdk.stream(list(problem.prompt_ids), max_tokens=GEN, temperature=0.0, **KNOBS))
            assert [t for c in chunks for t in c.token_ids] == expected
            assert all(len(c.token_ids) <= KNOBS["block_length"] for c in chunks)
        with pytest.raises(InvalidRequestError, match="block_length"):
            sdk.generate(list(PROBLEMS[0].prompt_ids), max_tokens=GEN, block_length=5)


@pytest.mark.parametrize("extra, param", [
    ({"steps": 6}, "steps"),  # not a multiple of the 4 blocks
    ({"steps": 32}, "steps"),  # more steps than tokens
    ({"block_length": 5}, "block_length"),
    ({"retention_ratio": 0.0}, "retention_ratio"),
    ({"remasking": "top_k"}, "remasking"),
    ({"top_p": 0.5}, "top_p"),
    ({"session_id": "s-1"}, "session_id"),
    ({"prompt": [256, 49, tiny_task.MASK_ID]}, "prompt"),
])
def test_bad_knobs_get_400s_naming_the_field(up, extra, param):
    body = {"model": "tiny_model", "prompt": [256, 49, 50], "max_tokens": GEN, **KNOBS, **extra}
    reply = httpx.post(up["http"] + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_concurrent_requests_are_right_and_spread_over_both_workers(up, reference):
    ids = [f"dllm-{uuid.uuid4().hex[:8]}-{i}" for i in range(16)]

    def ask(i):
        problem = PROBLEMS[i % len(PROBLEMS)]
        with Client(up["grpc"], timeout_s=60) as sdk:
            return sdk.generate(list(problem.prompt_ids), max_tokens=GEN, temperature=0.0, request_id=ids[i],
                                **KNOBS).token_ids

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(ids))))
    assert answers == [reference["greedy"][i % len(PROBLEMS)] for i in range(len(ids))]
    records = [finished_record(up["prefix"], request_id) for request_id in ids]
    assert all(len(r.stages) == 1 for r in records)  # whole, on one worker: no split, no KV moved
    assert len({r.stages[0]["worker_id"] for r in records}) == 2  # least-loaded among the diffusion workers
