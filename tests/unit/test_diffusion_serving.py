"""Serving a diffusion model (issue 15), the pure parts: the denoising knobs' defaults and errors,
the API's 400s, the wire, the SDK's request, and placement by engine family."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokenization import Tokenization
from gateway.validation import Limits, chat_request, completion_request, generate_request
from services.global_scheduler.baselines import LeastLoadedPolicy, RoundRobinPolicy
from services.global_scheduler.policy import (ClusterView, NoWorkerAvailable, PlacementRequest, WorkerView,
                                              place_diffusion)
from services.global_scheduler.view import _place
from splitserve.client import build_generate_request
from splitserve.core.diffusion import DEFAULT_BLOCK_LENGTH, DiffusionParamError, diffusion_params
from splitserve.errors import InvalidArgument
from splitserve.proto import gateway_pb2, types_pb2
from splitserve.state.store import WorkerLoad
from splitserve.core.records import DIFFUSION, engine_family
from splitserve.wire import sampling_from_proto

from tests.unit.test_gateway_validation import ByteTokenizer

MASK = 299
TOK = Tokenization(ByteTokenizer(), max_model_len=64, vocab_size=300, model_type="llada", mask_token_id=MASK)
DIFFUSION_LIMITS = Limits(served_model="llada", max_model_len=64, default_max_tokens=16, max_tokens_limit=40,
                          engine_family=DIFFUSION, mask_token_id=MASK)
AR_LIMITS = Limits(served_model="llama", max_model_len=64, default_max_tokens=16, max_tokens_limit=40)


# ---- the knobs ------------------------------------------------------------------------------------

def test_defaults_one_step_per_token_blocks_of_32_when_they_divide():
    p = diffusion_params(64)
    assert (p.gen_length, p.block_length, p.steps) == (64, DEFAULT_BLOCK_LENGTH, 64)
    p = diffusion_params(40)  # 32 does not divide 40: one block
    assert (p.block_length, p.steps) == (40, 40)
    p = diffusion_params(64, steps=3)  # 3 steps cannot spread over 2 default blocks: one block
    assert (p.block_length, p.steps) == (64, 3)
    p = diffusion_params(64, steps=8, block_length=16)
    assert (p.num_blocks, p.steps_per_block) == (4, 2)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=16, steps=0), "steps"),
    (dict(max_tokens=16, steps=6, block_length=4), "steps"),
    (dict(max_tokens=16, steps=17), "steps"),
    (dict(max_tokens=16, block_length=5), "block_length"),
    (dict(max_tokens=16, block_length=0), "block_length"),
    (dict(max_tokens=16, remasking="entropy"), "remasking"),
    (dict(max_tokens=16, retention_ratio=0.0), "retention_ratio"),
    (dict(max_tokens=16, retention_ratio=1.5), "retention_ratio"),
    (dict(max_tokens=16, temperature=-1.0), "temperature"),
])
def test_knob_errors_name_their_field(kwargs, param):
    max_tokens = kwargs.pop("max_tokens")
    with pytest.raises(DiffusionParamError) as info:
        diffusion_params(max_tokens, **kwargs)
    assert info.value.param == param and param in str(info.value)


@settings(max_examples=200, deadline=None)
@given(max_tokens=st.integers(1, 512), steps=st.none() | st.integers(1, 600),
       block_length=st.none() | st.integers(1, 600))
def test_knobs_are_either_valid_or_refused_naming_a_field(max_tokens, steps, block_length):
    # The rules, written out: blocks of 32 by default when 32 divides max_tokens and the steps,
    # else one block; a block must divide max_tokens, the steps must be a multiple of the number
    # of blocks and at most max_tokens.
    block = block_length
    if block is None:
        block = 32 if max_tokens % 32 == 0 else max_tokens
        if steps is not None and steps % (max_tokens // block):
            block = max_tokens
    wanted_steps = max_tokens if steps is None else steps
    refusal = ("block_length" if max_tokens % block else
               "steps" if wanted_steps % (max_tokens // block) or wanted_steps > max_tokens else None)
    try:
        p = diffusion_params(max_tokens, steps=steps, block_length=block_length)
    except DiffusionParamError as err:
        assert err.param == refusal
        return
    assert refusal is None
    assert p.num_blocks * p.block_length == max_tokens and p.steps_per_block * p.num_blocks == p.steps
    assert 1 <= p.steps <= max_tokens
    if steps is not None:
        assert p.steps == steps
    if block_length is not None:
        assert p.block_length == block_length


def test_guidance_doubles_a_steps_query_tokens():
    from splitserve.core.diffusion import DiffusionSequence

    plain = DiffusionSequence("a", 10, diffusion_params(16, block_length=4, steps=8))
    guided = DiffusionSequence("b", 10, diffusion_params(16, block_length=4, steps=8, cfg_scale=1.0))
    assert (plain.query_tokens("none"), guided.query_tokens("none")) == (26, 52)
    assert (plain.query_tokens("dual"), guided.query_tokens("dual")) == (26, 52)  # a Refresh
    plain.advance(), guided.advance()
    assert (plain.query_tokens("dual"), guided.query_tokens("dual")) == (4, 8)  # a Reuse


# ---- the API -------------------------------------------------------------------------------------

def test_diffusion_knobs_reach_the_submit_request():
    req = completion_request({"prompt": "123=", "max_tokens": 16, "steps": 8, "block_length": 4,
                              "remasking": "random", "retention_ratio": 0.5, "temperature": 0.0},
                             TOK, DIFFUSION_LIMITS, "r1")
    submit = req.submit_request()
    assert submit.engine_family == DIFFUSION
    s = submit.sampling
    assert (s.steps, s.block_length, s.remasking, s.retention_ratio) == (8, 4, "random", 0.5)
    core = sampling_from_proto(s)
    assert (core.steps, core.block_length, core.remasking, core.retention_ratio) == (8, 4, "random", 0.5)


def test_unset_knobs_stay_unset_on_the_wire():
    req = chat_request({"messages": [{"role": "user", "content": "123="}], "max_tokens": 16}, TOK,
                       DIFFUSION_LIMITS, "r1")
    s = req.submit_request().sampling
    assert not s.HasField("steps") and not s.HasField("block_length") and not s.HasField("retention_ratio")
    assert s.remasking == ""
    core = sampling_from_proto(s)
    assert (core.steps, core.block_length, core.remasking, core.retention_ratio) == (None, None, "low_confidence", 1.0)


@pytest.mark.parametrize("body, param", [
    ({"steps": 6, "block_length": 4}, "steps"),
    ({"steps": 32}, "steps"),
    ({"block_length": 5}, "block_length"),
    ({"block_length": -4}, "block_length"),
    ({"remasking": "entropy"}, "remasking"),
    ({"retention_ratio": 0}, "retention_ratio"),
    ({"retention_ratio": 2.0}, "retention_ratio"),
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"session_id": "s"}, "session_id"),
    ({"prompt": [256, 49, MASK]}, "prompt"),
    ({"steps": "8"}, "steps"),  # strict JSON types
    ({"cfg_scale": -0.5}, "cfg_scale"),
])
def test_diffusion_model_refuses_bad_knobs_naming_the_field(body, param):
    with pytest.raises(InvalidArgument) as info:
        completion_request({"prompt": "12=", "max_tokens": 16, **body}, TOK, DIFFUSION_LIMITS, "r1")
    assert info.value.param == param


@pytest.mark.parametrize("field, value", [("steps", 8), ("block_length", 4), ("remasking", "random"),
                                          ("retention_ratio", 0.5), ("cfg_scale", 1.0)])
def test_autoregressive_model_refuses_the_knobs(field, value):
    with pytest.raises(InvalidArgument) as info:
        completion_request({"prompt": "hi", "max_tokens": 16, field: value}, TOK, AR_LIMITS, "r1")
    assert info.value.param == field and "only diffusion models" in info.value.message
    plain = completion_request({"prompt": "hi", "max_tokens": 16}, TOK, AR_LIMITS, "r1")
    assert plain.submit_request().engine_family == ""


def test_grpc_generate_request_carries_and_checks_the_knobs():
    msg = build_generate_request([256, 49, 50, 61], max_tokens=16, steps=8, block_length=4, remasking="random",
                                 retention_ratio=0.75, cfg_scale=1.5)
    s = msg.sampling
    assert (s.steps, s.block_length, s.remasking, s.retention_ratio, s.cfg_scale) == (8, 4, "random", 0.75, 1.5)
    assert sampling_from_proto(s).cfg_scale == 1.5
    req = generate_request(msg, TOK, DIFFUSION_LIMITS, "r1")
    assert (req.steps, req.block_length, req.remasking, req.retention_ratio, req.engine_family) == \
        (8, 4, "random", 0.75, DIFFUSION)
    with pytest.raises(InvalidArgument) as info:
        generate_request(build_generate_request([256, 49], max_tokens=16, block_length=3), TOK, DIFFUSION_LIMITS,
                         "r1")
    assert info.value.param == "block_length"
    with pytest.raises(InvalidArgument) as info:
        generate_request(msg, TOK, AR_LIMITS, "r1")
    assert info.value.param == "steps"
    plain = build_generate_request([1, 2], max_tokens=4)
    assert not plain.sampling.HasField("steps") and plain.sampling.remasking == ""
    assert isinstance(plain, gateway_pb2.GenerateRequest) and isinstance(plain.sampling, types_pb2.SamplingParams)


# ---- placement ----------------------------------------------------------------------------------

def _worker(worker_id, kind, running=0, waiting=0, inflight=0, draining=False, free=100):
    load = WorkerLoad(worker_id, role="both", engine_kind=kind, free_blocks=free, total_blocks=100, block_size=16,
                      running=running, waiting=waiting, draining=draining)
    return WorkerView(worker_id, f"h:{worker_id}", load, inflight)


def _request(family=""):
    return PlacementRequest("r", prompt_len=10, max_tokens=16, engine_family=family)


def test_engine_family_of_a_kind():
    assert engine_family("llada") == DIFFUSION
    assert engine_family("LlamaForCausalLM") == "" and engine_family("emulated") == ""


def test_diffusion_request_goes_whole_to_the_least_loaded_diffusion_worker():
    view = ClusterView((_worker("ar-0", "LlamaForCausalLM"), _worker("d-0", "llada", running=3),
                        _worker("d-1", "llada", running=1, inflight=1), _worker("d-2", "llada", draining=True)), 0.0)
    placement = place_diffusion(_request(DIFFUSION), view)
    assert placement.worker_ids == ("d-1",) and placement.stages[0].end == 26
    assert _place(RoundRobinPolicy(), _request(DIFFUSION), view, lambda: 0.0).worker_ids == ("d-1",)


def test_autoregressive_request_never_lands_on_a_diffusion_worker():
    # The idle diffusion worker would win least_loaded, but it is not in the request's view.
    view = ClusterView((_worker("ar-0", "LlamaForCausalLM", running=5, free=10), _worker("d-0", "llada")), 0.0)
    family_view = view.of_family("")
    assert [w.worker_id for w in family_view.workers] == ["ar-0"]
    assert _place(LeastLoadedPolicy(), _request(), family_view, lambda: 0.0).worker_ids == ("ar-0",)
    with pytest.raises(NoWorkerAvailable):
        place_diffusion(_request(DIFFUSION), view.of_family(""))
    # Unfiltered, the policy would have chosen the idle diffusion worker: the filter is what keeps it off.
    assert LeastLoadedPolicy().place(_request(), view, 0.0).worker_ids == ("d-0",)


def test_a_guided_request_that_could_never_fit_a_step_is_refused_up_front():
    from splitserve.core.diffusion import DiffusionScheduler, DiffusionSchedulerConfig, DiffusionSequence

    scheduler = DiffusionScheduler(DiffusionSchedulerConfig(max_num_batched_tokens=100, cache="none"))
    guided = DiffusionSequence("g", 40, diffusion_params(16, block_length=4, steps=8, cfg_scale=1.0))  # 2 x 56 > 100
    with pytest.raises(DiffusionParamError) as info:
        scheduler.add(guided)
    assert info.value.param == "cfg_scale" and "112 > max_num_batched_tokens (100)" in str(info.value)
    scheduler.add(DiffusionSequence("plain", 40, diffusion_params(16, block_length=4, steps=8)))  # 56 fits
    scheduler.add(DiffusionSequence("small", 30, diffusion_params(16, block_length=4, steps=8, cfg_scale=1.0)))
    assert len(scheduler.schedule().entries) == 1  # 56 + 92 > 100: FCFS, the second waits its turn
