"""A worker refuses a bad stage with INVALID_ARGUMENT naming the field at fault (issue 36).

A real emulated worker process over gRPC: the field arrives as the `splitserve-param`
trailing metadata, taken from the core's typed error (`InvalidInput.param`), never parsed out
of the message (tests/unit/test_typed_errors.py shows that a message naming another field
does not change it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import grpc
import pytest

from splitserve.errors import PARAM_KEY
from splitserve.cli.launcher import wait_port_healthy
from splitserve.proto import types_pb2, worker_pb2, worker_pb2_grpc
from splitserve.redis_server import free_port

VOCAB = 128_256  # llama-3-8b's, the emulated preset's


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("worker-errors") / "worker.log"
    command = [sys.executable, "-m", "splitserve.cli", "serve", "worker", "--backend", "emulated", "--gpu", "H100",
               "--model-preset", "llama-3-8b", "--port", str(port), "--metrics-port", str(free_port()),
               "--worker-id", "errors-0", "--redis-url", os.environ["SPLITSERVE_TEST_REDIS_URL"],
               "--redis-prefix", f"ss:errors-{uuid.uuid4().hex[:8]}:", "--no-log-json"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port_healthy(f"127.0.0.1:{port}", proc, 60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _refusal(call) -> tuple[grpc.StatusCode, str | None, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    return err.code(), dict(err.trailing_metadata() or ()).get(PARAM_KEY), err.details()


def _execute(stub, **fields):
    sampling = fields.pop("sampling", {"max_tokens": 4})
    stage = types_pb2.Stage(request_id=f"bad-{uuid.uuid4().hex[:8]}", prompt_token_ids=fields.pop("prompt", [1, 2, 3]),
                            sampling=types_pb2.SamplingParams(**sampling), **fields)
    return lambda: list(stub.Execute(stage, timeout=10))


@pytest.mark.parametrize("fields, param", [
    ({"sampling": {"max_tokens": 4, "top_p": 2.0}}, "top_p"),
    ({"sampling": {"max_tokens": 4, "temperature": -1.0}}, "temperature"),
    ({"sampling": {"max_tokens": 4, "stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"generated_token_ids": [5, 6, 7, 8]}, "output_token_ids"),
    ({"kv_sources": [types_pb2.KvSource(worker_id="a"), types_pb2.KvSource(worker_id="b")]}, "kv_sources"),
])
def test_a_bad_stage_is_refused_naming_its_field(stub, fields, param):
    code, got, details = _refusal(_execute(stub, **fields))
    assert (code, got) == (grpc.StatusCode.INVALID_ARGUMENT, param), details
    # The worker still serves: the refusal left nothing behind.
    assert list(stub.Execute(types_pb2.Stage(request_id=f"ok-{uuid.uuid4().hex[:8]}", prompt_token_ids=[1, 2, 3],
                                             sampling=types_pb2.SamplingParams(max_tokens=2)), timeout=10))


def test_a_reservation_starting_inside_a_block_is_refused_naming_start(stub):
    request = worker_pb2.PrepareKvRequest(request_id="r", transfer_id="r:0", num_tokens=64, start=3)
    code, param, details = _refusal(lambda: stub.PrepareKv(request, timeout=10))
    assert (code, param) == (grpc.StatusCode.INVALID_ARGUMENT, "start"), details


def test_a_pull_of_blocks_this_worker_lacks_is_refused_naming_block_ids(stub):
    request = worker_pb2.PullKvRequest(transfer_id="t", request_id="r", block_ids=[1 << 30], start=0, end=16)
    code, param, details = _refusal(lambda: list(stub.PullKv(request, timeout=10)))
    assert (code, param) == (grpc.StatusCode.INVALID_ARGUMENT, "block_ids"), details
