"""`splitserve profile` against real worker processes.

A real worker on the tiny llama (CPU) is profiled over a small grid by the CLI (prefill,
decode and mixed steps): the fitted model must predict every measured sample, mixed steps
beside the grid get a reported error, the JSON file and the Redis entry must both hold it, the worker's KV must all be free again, and a request streaming while the profile runs
must produce exactly the tokens it produces alone. An emulated worker is profiled too: its
steps *are* the H100 x Llama-3-8B preset's times, so the fit must recover the preset, and
the fitted JSON then drives an emulated worker's and the simulator's timings.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import uuid

import grpc
import pytest

from splitserve.cli.launcher import wait_port_healthy
from splitserve.perf.model import PerfModel, ProfileSample
from splitserve.perf.presets import preset
from splitserve.cli.profile import load_perf_model
from splitserve.proto import types_pb2, worker_pb2, worker_pb2_grpc
from splitserve.redis_server import free_port
from splitserve.state.store import StateStore

REDIS = os.environ.get("SPLITSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _start_worker(args: list[str], log_path, prefix: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "worker", "--port", str(port),
           "--metrics-port", str(free_port()), "--redis-url", REDIS, "--redis-prefix", prefix, "--no-log-json", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_port_healthy(address, proc, 90)
    except BaseException:
        proc.terminate()
        proc.wait(timeout=15)
        raise
    return proc, address


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _profile_cli(address: str, out, prefix: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "splitserve.cli", "profile", "--worker", address, "--out", str(out),
           "--redis-url", REDIS, "--redis-prefix", prefix, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _redis_doc(prefix: str, worker_id: str) -> dict | None:
    async def read():
        async with StateStore(REDIS, prefix) as store:
            return await store.get_perf(worker_id)

    return asyncio.run(read())


def _rel_errors(model: PerfModel, doc: dict) -> dict[str, list[float]]:
    errors: dict[str, list[float]] = {"prefill": [], "decode": [], "transfer": [], "mixed": []}
    for raw in doc["profile"]["samples"]:
        s = ProfileSample.from_dict(raw)
        if s.kind == "prefill":
            pred = model.prefill_time(s.l_hist, s.l_incr)
        elif s.kind == "decode":
            pred = model.decode_time(s.batch, s.ctx)
        elif s.kind == "mixed":
            pred = model.mixed_step_time(s.l_incr, s.l_hist, s.batch, s.ctx)
        else:
            pred = model.kv_transfer_time(s.tokens)
        errors[s.kind].append(abs(pred - s.seconds) / s.seconds)
    return errors


def _generate(stub, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    stage = types_pb2.Stage(request_id=request_id, prompt_token_ids=prompt,
                            sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [t for chunk in stub.Execute(stage, timeout=120) for t in chunk.token_ids]


# ---- a real worker -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_worker(tiny_model_dirs, tmp_path_factory):
    prefix = f"ss:prof-{uuid.uuid4().hex[:8]}:"
    proc, address = _start_worker(["--model", str(tiny_model_dirs["llama"]), "--worker-id", "prof-real",
                                   "--kv-cache-memory-bytes", str(4 << 20), "--max-num-seqs", "16"],
                                  tmp_path_factory.mktemp("profile-worker") / "worker.log", prefix)
    try:
        yield address, prefix
    finally:
        _stop(proc)


def test_profile_fits_a_real_worker_and_stores_json_and_redis(real_worker, tmp_path):
    address, prefix = real_worker
    out = tmp_path / "perf.json"
    done = _profile_cli(address, out, prefix, "--prefill-lens", "8,32,96,192", "--history-lens", "0,128,256",
                        "--decode-batch", "1,4,8", "--decode-ctx", "16,128,320", "--repeats", "5",
                        "--mixed-chunk", "16,96", "--mixed-history", "0,128", "--mixed-batch", "1,8",
                        "--mixed-ctx", "32,256", "--transfer-tokens", "16,64,256,1024")
    assert "wrote" in done.stdout and "mixed: 16 samples" in done.stdout

    doc = json.loads(out.read_text())
    model = PerfModel.from_dict(doc)
    prof = doc["profile"]
    assert prof["worker_id"] == "prof-real" and prof["engine_kind"] == "LlamaForCausalLM"
    assert prof["device"] == "cpu"
    assert prof["measured_kinds"] == ["decode", "mixed", "prefill", "transfer"]
    kinds = [s["kind"] for s in prof["samples"]]
    assert kinds.count("prefill") == 12 and kinds.count("decode") == 9 and kinds.count("transfer") == 4
    assert kinds.count("mixed") == 16 and prof["grid"]["mixed_decode_batch_sizes"] == [1, 8]
    # KV bytes per token from the pulled payload: 2 layers x K,V x 2 heads x 16 dims x fp32.
    assert model.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4

    errors = _rel_errors(model, doc)
    shown = {k: [round(e, 3) for e in v] for k, v in errors.items()}
    # The mixed steps' fit is reported (and stored) like every kind's; its accuracy target
    # (15% on held-out mixed steps) is benchmarks/profile_mixed.py's to check, not a timed test's.
    mixed_fit = doc["fit"]["mixed"]
    assert mixed_fit["n"] == 16 and mixed_fit["mean_rel"] == pytest.approx(statistics.fmean(errors.pop("mixed")))
    # A CPU on a shared 2-core box: timings of a tiny model jitter by tens of percent, and by
    # more when other jobs load it (a single sample then lands anywhere). The fit must follow
    # the bulk of the samples; how accurate it is on an idle machine is a benchmark's to say
    # (benchmarks/profile_mixed.py), not a timed test's.
    for kind, errs in errors.items():
        assert all(math.isfinite(e) for e in errs), f"{kind} fit errors {shown}"
        assert statistics.median(errs) < 0.5, f"{kind} fit errors {shown}"
    # Bigger shapes take longer, and the fit says so. A decode step of this 2-layer, 16-dim
    # model is almost all fixed per-step cost on this grid: its fitted slopes may be zero
    # (non-negative least squares), so it only must not fall.
    assert model.prefill_time(0, 192) > model.prefill_time(0, 8)
    assert model.decode_time(8, 320) >= model.decode_time(1, 16)
    assert model.kv_transfer_time(1024) > model.kv_transfer_time(16)

    stored = _redis_doc(prefix, "prof-real")
    assert stored == doc
    assert load_perf_model("redis:prof-real", REDIS, prefix) == model
    assert load_perf_model(str(out)) == model

    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        # Mixed steps off the grid (every L, H, B and C new): the fitted model predicts them, with
        # an error reported, not asserted tight (timing a 2-layer model on a shared box is noisy).
        held_out = stub.Profile(worker_pb2.ProfileRequest(
            prefill_lens=[8], history_lens=[0], decode_batch_sizes=[1], decode_context_lens=[16],
            mixed_prefill_lens=[48], mixed_history_lens=[64], mixed_decode_batch_sizes=[4, 6],
            mixed_decode_context_lens=[96, 180], repeats=5), timeout=120)
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert load.free_blocks == load.total_blocks, "the synthetic sequences' KV blocks must all come back"
    mixed = [s for s in held_out.samples if s.kind == "mixed"]
    assert len(mixed) == 4 and all(s.seconds > 0 for s in mixed)
    held_errors = [abs(model.mixed_step_time(s.l_incr, s.l_hist, s.batch, s.ctx) - s.seconds) / s.seconds
                   for s in mixed]
    print(f"held-out mixed steps: mean error {statistics.fmean(held_errors):.1%}, max {max(held_errors):.1%}")
    assert statistics.median(held_errors) < 1.0, held_errors  # a sanity bound: within 2x


def test_profile_runs_beside_live_requests_without_changing_their_tokens(real_worker):
    address, _ = real_worker
    prompt = [(i * 37 + 11) % 300 + 3 for i in range(40)]
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        alone = _generate(stub, "alone", prompt, 160)
        got: dict[str, list[int]] = {}
        streaming = threading.Thread(target=lambda: got.update(busy=_generate(stub, "busy", prompt, 160)))
        streaming.start()
        response = stub.Profile(worker_pb2.ProfileRequest(prefill_lens=[64, 200], history_lens=[0, 200],
                                                          decode_batch_sizes=[4, 12], decode_context_lens=[100, 250],
                                                          mixed_prefill_lens=[64], mixed_history_lens=[100],
                                                          mixed_decode_batch_sizes=[3, 8],
                                                          mixed_decode_context_lens=[120], repeats=3), timeout=120)
        streaming.join(timeout=120)
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert len(response.samples) == 10 and all(s.seconds > 0 for s in response.samples)
    assert sum(s.kind == "mixed" for s in response.samples) == 2
    assert got["busy"] == alone, "a request running during the profile must produce the same tokens"
    assert load.free_blocks == load.total_blocks


def test_profile_rejects_a_bad_grid_and_skips_shapes_that_do_not_fit(real_worker):
    address, _ = real_worker
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Profile(worker_pb2.ProfileRequest(prefill_lens=[16], repeats=1000), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "repeats" in err.value.details()
        # 600 tokens exceed the tiny model's 512 positions; 17 sequences exceed its max_num_seqs
        # (16), and so do 16 decodes beside a prefill chunk.
        response = stub.Profile(worker_pb2.ProfileRequest(prefill_lens=[16, 600], history_lens=[0],
                                                          decode_batch_sizes=[16, 17], decode_context_lens=[16],
                                                          mixed_prefill_lens=[16, 600], mixed_history_lens=[0],
                                                          mixed_decode_batch_sizes=[4, 16],
                                                          mixed_decode_context_lens=[16], repeats=1), timeout=60)
    shapes = sorted((s.kind, s.l_incr, s.batch, s.ctx) for s in response.samples)
    assert shapes == [("decode", 0, 16, 16), ("mixed", 16, 4, 16), ("prefill", 16, 0, 0)]


# ---- an emulated worker: the fit recovers the preset it emulates --------------------------------

def test_profile_of_an_emulated_worker_recovers_its_preset(tmp_path, monkeypatch):
    prefix = f"ss:prof-{uuid.uuid4().hex[:8]}:"
    # --perf-backend datasheet: the steps are the preset's max-of-two-lines times (the default,
    # measured kernel tables, is a different model that this test does not compare against).
    proc, address = _start_worker(["--backend", "emulated", "--gpu", "H100", "--model-preset", "llama-3-8b",
                                   "--perf-backend", "datasheet", "--worker-id", "prof-emu"],
                                  tmp_path / "worker.log", prefix)
    try:
        out = tmp_path / "emu.json"
        _profile_cli(address, out, prefix, "--prefill-lens", "64,512,2048,4096", "--history-lens", "0,2048,6000",
                     "--decode-batch", "1,16,64,128", "--decode-ctx", "256,2048,4000", "--repeats", "3")
    finally:
        _stop(proc)
    doc = json.loads(out.read_text())
    fitted, truth = PerfModel.from_dict(doc), preset("H100", "llama-3-8b")
    assert doc["profile"]["device"] == "emulated:H100-SXM5-80GBx1/Llama-3-8B"
    assert doc["profile"]["measured_kinds"] == ["decode", "mixed", "prefill"]  # the default mixed grid too
    assert fitted.transfer == truth.transfer and fitted.kv_bytes_per_token == truth.kv_bytes_per_token
    # The emulated worker sleeps wall-clock time: on a shared box its wake-ups run a few ms late.
    def close(got: float, want: float) -> bool:
        return abs(got - want) <= 0.12 * want + 0.002

    for h, n in [(0, 128), (0, 1024), (1000, 1000), (4000, 3000)]:
        assert close(fitted.prefill_time(h, n), truth.prefill_time(h, n)), (h, n)
    for b, c in [(1, 512), (8, 1024), (32, 3000), (100, 1000)]:
        assert close(fitted.decode_time(b, c), truth.decode_time(b, c)), (b, c)
    for h, n, b, c in [(0, 100, 4, 300), (128, 300, 16, 200), (200, 64, 20, 450)]:  # within the mixed grid
        assert close(fitted.mixed_step_time(n, h, b, c), truth.mixed_step_time(n, h, b, c)), (h, n, b, c)
    assert _redis_doc(prefix, "prof-emu") == doc
    # The simulator takes the stored model straight from Redis.
    from services.planner.cli import ClusterOptions, build_simulator

    monkeypatch.setenv("SPLITSERVE_REDIS_URL", REDIS)
    monkeypatch.setenv("SPLITSERVE_REDIS_PREFIX", prefix)
    sim = build_simulator(ClusterOptions(workers=2, perf_model="redis:prof-emu"))
    assert sim.config.perf_model == fitted


def test_a_fitted_model_drives_the_emulated_runner_and_the_simulator(tmp_path):
    from services.planner.cli import ClusterOptions, build_simulator
    from workers.engine.config import EngineConfig
    from workers.engine.emulated import Emulation, EmulatedRunner, emulated_spec

    slow = preset("A100", "llama-3-8b")  # any model other than the H100 preset
    path = tmp_path / "fitted.json"
    slow.save(path)
    emulation = Emulation("H100", "llama-3-8b", perf_model_path=str(path))
    runner = EmulatedRunner(EngineConfig(model="", kv_cache_memory_bytes=1 << 30), emulation,
                            emulated_spec(emulation))
    assert runner.perf == slow
    sim = build_simulator(ClusterOptions(workers=2, perf_model=path))
    assert sim.config.perf_model == slow
