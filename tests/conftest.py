"""Shared fixtures: tiny random Hugging Face models built offline, once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# transformers prints progress bars on every save/load; they drown test output.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The real traces (../shared/traces beside the checkout); SPLITSERVE_TRACES_DIR points
# elsewhere. Tests that read them are skipped, saying so, where they are absent.
TRACES_DIR = Path(os.environ.get("SPLITSERVE_TRACES_DIR") or REPO_ROOT.parent / "shared" / "traces")
needs_traces = pytest.mark.skipif(not TRACES_DIR.is_dir(), reason=f"no traces at {TRACES_DIR} (set SPLITSERVE_TRACES_DIR)")

def prefix_sharing_workload() -> list:
    """Simulator items: 120 requests sharing prefix blocks (as Mooncake's hash ids do) and 8 sessions."""
    import numpy as np

    from loadgen.sessions import Round, Session
    from services.planner.sim_workload import SimRequestSpec

    rng = np.random.default_rng(11)
    shared = list(range(40))
    items: list = []
    for i in range(120):
        k = int(rng.integers(0, 30))
        prefix = shared[:k] + [1000 + i * 50 + j for j in range(int(rng.integers(0, 6)))]
        items.append(SimRequestSpec(f"r{i}", int(rng.integers(16, 16 * (len(prefix) + 2))),
                                    int(rng.integers(1, 120)), tuple(prefix), 16))
    items += [Session(f"s{i}", [Round(200 + 40 * i, 30, 0.0), Round(120, 20, 0.01), Round(80, 40, 0.02)])
              for i in range(8)]
    return items


# A larger init range than real checkpoints so greedy outputs vary rather than repeat.
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


class ManualClock:
    """A clock a test moves by hand (`clock.now = ...`)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def policy_scheduler(policy, *, budget=4096, max_num_seqs=256, num_blocks=20_000, caching=False):
    """The real core `Scheduler` driving `policy` on a manual clock (blocks of 16 tokens)."""
    from splitserve.core import BlockManager, Scheduler, SchedulerConfig

    return Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len=1 << 20, vocab_size=None),
                     BlockManager(num_blocks, 16, caching), policy, ManualClock())


_prompt_tokens = iter(range(1000, 1 << 40))


def add_request(sched, rid, prompt_len, ttft_s=None, max_tokens=4) -> None:
    """A whole request of `prompt_len` fresh tokens (no prefix shared with any other)."""
    from splitserve.core import SamplingParams, StageSlo, StageSpec

    prompt = [next(_prompt_tokens) for _ in range(prompt_len)]
    sched.add_stage(StageSpec.whole(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                    slo=StageSlo(ttft_s=ttft_s)))


def run_step(sched, perf_model):
    """Schedule one step, 'run' it for the time `perf_model` predicts, sample one token per sampling entry."""
    from splitserve.core import step_time

    out = sched.schedule()
    latency = step_time(perf_model, out.shape)
    sched.update_from_output(out, {e.seq.key: 1 for e in out.entries if e.samples}, latency)
    sched.clock.now += latency
    return out


def _tiny_spec(arch: str, **overrides):
    from splitserve.cli.demo_model import DemoModelSpec

    base = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, vocab_size=384, max_position_embeddings=512,
                seed=1234, initializer_range=0.2)
    base.update(overrides)
    return DemoModelSpec(**base)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny float32 model directory per architecture, plus variants."""
    from splitserve.cli.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {arch: build_demo_model(_tiny_spec(arch), root / arch) for arch in TINY_ARCHS}
    dirs["llama3-tied"] = build_demo_model(
        _tiny_spec(
            "llama",
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        root / "llama3-tied",
    )
    return dirs


@pytest.fixture(scope="session")
def paced_model_dir(tmp_path_factory) -> Path:
    """A random Llama big enough that a decode step takes milliseconds (~6 ms alone here; the
    tiny models take 1), for tests that kill a worker at a token count the client has read: a
    client can read behind the cluster, and on the tiny model a loaded machine let the request
    finish before the kill reached it (the test then proved nothing, or missed its moment).
    Its offline reference runs on one torch thread: two, beside any other busy process on a
    2-core machine, took 30x longer (a parallel region waits for its descheduled thread)."""
    from splitserve.cli.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                         intermediate_size=1536, vocab_size=384, max_position_embeddings=512, seed=18,
                         initializer_range=0.05)
    return build_demo_model(spec, tmp_path_factory.mktemp("paced-model"))


_private_redis = None


def pytest_configure(config):
    """Point every test at a reachable Redis: the configured one, or a private server."""
    global _private_redis
    from splitserve.redis_server import ensure_redis

    url = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    resolved, _private_redis = ensure_redis(url)
    os.environ["SPLITSERVE_TEST_REDIS_URL"] = resolved


def pytest_unconfigure(config):
    if _private_redis is not None:
        _private_redis.stop()


@pytest.fixture(scope="session")
def cluster(tiny_model_dirs, tmp_path_factory):
    """A whole local cluster: scheduler, coordinator, 2 workers, gateway, own Redis prefix."""
    import uuid

    from splitserve.cli.launcher import ClusterSpec, start_cluster
    from splitserve.redis_server import free_port

    log_dir = tmp_path_factory.mktemp("cluster-logs")
    spec = ClusterSpec(
        model=str(tiny_model_dirs["llama"]),
        workers=2,
        policy="least_loaded",
        http_port=free_port(),
        grpc_port=free_port(),
        redis_url=os.environ["SPLITSERVE_TEST_REDIS_URL"],
        redis_prefix=f"ss:test-{uuid.uuid4().hex[:8]}:",
        log_dir=log_dir,
        worker_args={"kv_cache_memory_bytes": 8 << 20, "max_num_seqs": 32},
        gateway_args={"max_tokens_limit": 256, "max_message_bytes": 1 << 20, "max_request_body_bytes": 1 << 20},
    )
    running = start_cluster(spec)
    yield running
    running.stop()


@pytest.fixture
def prefix(request):
    """A Redis key prefix of the test's own (named after its module); its keys are deleted after it.
    (Integration tests' Redis at SPLITSERVE_TEST_REDIS_URL; a module may define its own.)"""
    import asyncio
    import uuid

    import redis.asyncio as aioredis

    url = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    tag = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")
    value = f"ss:test-{tag}-{uuid.uuid4().hex[:8]}:"
    yield value

    async def cleanup():
        client = aioredis.Redis.from_url(url)
        keys = [k async for k in client.scan_iter(match=f"{value}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    asyncio.run(cleanup())
