"""The core's refusals are typed and name their field; each mapping to the services' errors,
to gRPC and to HTTP reads the type and `param`, never the message (issue 36)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from gateway.http_api import error_response
from splitserve.core import (BlockManager, FcfsPolicy, InvalidInput, KvInBlocks, SamplingParams, Scheduler,
                             SchedulerConfig, StageKey, StageKeyTaken, StageSpec)
from splitserve.core.diffusion import DiffusionParamError, DiffusionParams
from splitserve.errors import PARAM_KEY, InvalidArgument, Unavailable, abort, from_rpc_error
from splitserve.wire import service_error
from workers.engine_loop import StageBusy
from workers.stage_call import _refusal

VOCAB = 100


def _scheduler(max_model_len: int = 64, num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=max_model_len,
                                     vocab_size=VOCAB), BlockManager(num_blocks, 4, False), FcfsPolicy(), lambda: 0.0)


def _spec(prompt=(1, 2, 3), **options) -> StageSpec:
    sampling = options.pop("sampling", SamplingParams(max_tokens=4))
    return StageSpec(StageKey("r", 0), tuple(prompt), sampling, **options)


@pytest.mark.parametrize("spec, param", [
    (_spec(prompt=()), "prompt"),
    (_spec(prompt=(1, VOCAB)), "prompt"),
    (_spec(output_ids=(VOCAB,)), "output_token_ids"),
    (_spec(output_ids=(5, 6, 7, 8)), "output_token_ids"),
    (_spec(sampling=SamplingParams(max_tokens=0)), "max_tokens"),
    (_spec(sampling=SamplingParams(max_tokens=4, temperature=-1)), "temperature"),
    (_spec(sampling=SamplingParams(max_tokens=4, top_k=-1)), "top_k"),
    (_spec(sampling=SamplingParams(max_tokens=4, top_p=0)), "top_p"),
    (_spec(sampling=SamplingParams(max_tokens=4, seed=-1)), "seed"),
    (_spec(sampling=SamplingParams(max_tokens=4, stop=[""])), "stop"),
    (_spec(sampling=SamplingParams(max_tokens=4, stop=["x"])), "stop"),  # no tokenizer here
    (_spec(sampling=SamplingParams(max_tokens=4, stop_token_ids=[VOCAB])), "stop_token_ids"),
    (_spec(sampling=SamplingParams(max_tokens=62)), "prompt"),  # over max_model_len
    (_spec(kv=KvInBlocks((0,), 3)), "kv"),  # KV of every known token: nothing left to compute
    (_spec(kv=KvInBlocks((0,), 2), end=2), "end"),
])
def test_the_scheduler_refuses_a_stage_with_a_typed_error_naming_the_field(spec, param):
    with pytest.raises(InvalidInput) as info:
        _scheduler().add_stage(spec)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)  # callers that only know "bad input" still catch it


def test_a_request_larger_than_the_kv_cache_names_the_prompt():
    with pytest.raises(InvalidInput) as info:
        _scheduler(max_model_len=1000, num_blocks=2).add_stage(_spec(sampling=SamplingParams(max_tokens=20)))
    assert info.value.param == "prompt" and "KV cache capacity" in info.value.message


def test_a_stage_key_in_use_is_its_own_type_not_bad_input():
    scheduler = _scheduler()
    scheduler.add_stage(_spec())
    with pytest.raises(StageKeyTaken) as info:
        scheduler.add_stage(_spec())
    assert not isinstance(info.value, InvalidInput)


def test_a_diffusion_knob_error_is_the_cores_typed_error():
    with pytest.raises(DiffusionParamError) as info:
        DiffusionParams(gen_length=8, block_length=3, steps=8)
    assert isinstance(info.value, InvalidInput) and info.value.param == "block_length"


def test_the_services_error_keeps_the_field_and_the_message():
    err = service_error(InvalidInput("top_p must be in (0, 1], got 2.0", param="top_p"))
    assert isinstance(err, InvalidArgument)
    assert (err.param, err.message, err.status, err.http_status) == ("top_p", "top_p must be in (0, 1], got 2.0",
                                                                     "INVALID_ARGUMENT", 400)


def test_the_worker_takes_the_field_from_the_type_not_the_message():
    # A message that starts with another field's name (once what the worker went by) changes nothing.
    refused = _refusal(InvalidInput("temperature is fine; top_p is not", param="top_p"))
    assert (type(refused), refused.param) == (InvalidArgument, "top_p")
    # An engine's untyped refusal blames the stage as a whole, whatever its message says.
    untyped = _refusal(ValueError("top_p must be in (0, 1]"))
    assert (type(untyped), untyped.param) == (InvalidArgument, "stage")


def test_a_busy_stage_is_retriable_elsewhere():
    assert isinstance(_refusal(StageBusy("request_id 'r' (stage 0) is already in the engine")), Unavailable)


class _Context:
    """What `abort` touches of a grpc.aio servicer context."""

    def __init__(self):
        self.trailing = ()
        self.status = None

    def set_trailing_metadata(self, trailing):
        self.trailing = trailing

    async def abort(self, code, details):
        self.status = (code, details)
        raise grpc.RpcError()


def test_grpc_carries_the_field_as_trailing_metadata():
    context = _Context()
    with pytest.raises(grpc.RpcError):
        asyncio.run(abort(context, service_error(InvalidInput("must be in (0, 1]", param="top_p"))))
    assert context.status == (grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]")
    assert (PARAM_KEY, "top_p") in context.trailing


class _RpcError(grpc.RpcError):
    def __init__(self, details: str, trailing=()):
        self._details, self._trailing = details, trailing

    def code(self):
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_the_field_comes_back_from_the_metadata_only():
    assert from_rpc_error(_RpcError("top_p: must be in (0, 1]", ((PARAM_KEY, "top_p"),))).param == "top_p"
    # A message that merely looks like "field: ..." names no field.
    assert from_rpc_error(_RpcError("top_p: must be in (0, 1]")).param is None


def test_http_answers_400_naming_the_field():
    response = error_response(service_error(InvalidInput("top_p must be in (0, 1]", param="top_p")))
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["param"] == "top_p"
