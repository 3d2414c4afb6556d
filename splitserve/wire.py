"""Plain records to and from their wire messages, each in one place.

Services speak protobuf at their edges and plain dataclasses inside; the conversions
live here so that a field added to a record is added to its message once. So does the
one from the core's typed errors to the services' (`service_error`).
"""

from __future__ import annotations

from splitserve.core.errors import InvalidInput
from splitserve.core.sampling import SamplingParams, TokenLogprobs
from splitserve.core.structured import StructuredOutput
from splitserve.errors import InvalidArgument
from splitserve.proto import types_pb2
from splitserve.core.records import WorkerLoad


def load_to_proto(load: WorkerLoad) -> types_pb2.WorkerLoad:
    return types_pb2.WorkerLoad(
        worker_id=load.worker_id, role=load.role, engine_kind=load.engine_kind, free_blocks=load.free_blocks,
        total_blocks=load.total_blocks, block_size=load.block_size, running=load.running, waiting=load.waiting,
        queued_prefill_tokens=load.queued_prefill_tokens, draining=load.draining,
        num_preemptions=load.num_preemptions, prefix_hit_rate=load.prefix_hit_rate,
        updated_unix_ms=round(load.updated_unix * 1000), prefix_hit_tokens=load.prefix_hit_tokens,
        pinned_sessions=load.pinned_sessions, pinned_blocks=load.pinned_blocks,
        session_history_lost=load.session_history_lost, pool=load.pool, busy_fraction=load.busy_fraction,
        length_boundary=load.length_boundary,
    )


def load_from_proto(message: types_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        worker_id=message.worker_id, role=message.role, engine_kind=message.engine_kind,
        free_blocks=message.free_blocks, total_blocks=message.total_blocks, block_size=message.block_size,
        running=message.running, waiting=message.waiting, queued_prefill_tokens=message.queued_prefill_tokens,
        num_preemptions=message.num_preemptions, prefix_hit_rate=message.prefix_hit_rate,
        prefix_hit_tokens=message.prefix_hit_tokens, pinned_sessions=message.pinned_sessions,
        pinned_blocks=message.pinned_blocks, session_history_lost=message.session_history_lost,
        draining=message.draining, updated_unix=message.updated_unix_ms / 1000, pool=message.pool,
        busy_fraction=message.busy_fraction, length_boundary=message.length_boundary,
    )


def sampling_from_proto(message: types_pb2.SamplingParams) -> SamplingParams:
    """Sampling parameters from the wire message (unset optionals take the engine defaults)."""
    params = SamplingParams(top_k=message.top_k, stop=list(message.stop), stop_token_ids=list(message.stop_token_ids),
                            ignore_eos=message.ignore_eos, min_tokens=message.min_tokens)
    if message.HasField("max_tokens"):
        params.max_tokens = message.max_tokens
    if message.HasField("temperature"):
        params.temperature = message.temperature
    if message.HasField("top_p"):
        params.top_p = message.top_p
    if message.HasField("seed"):
        params.seed = message.seed
    if message.HasField("steps"):
        params.steps = message.steps
    if message.HasField("block_length"):
        params.block_length = message.block_length
    if message.remasking:
        params.remasking = message.remasking
    if message.HasField("retention_ratio"):
        params.retention_ratio = message.retention_ratio
    if message.HasField("cfg_scale"):
        params.cfg_scale = message.cfg_scale
    for name in SAMPLING_FILTER_FIELDS:
        if message.HasField(name):
            setattr(params, name, getattr(message, name))
    if message.HasField("num_logprobs"):
        params.logprobs = message.num_logprobs
    if message.HasField("num_prompt_logprobs"):
        params.prompt_logprobs = message.num_prompt_logprobs
    if message.HasField("structured_output"):
        params.structured_output = structured_output_from_proto(message.structured_output)
    return params


def structured_output_from_proto(message: types_pb2.StructuredOutput) -> StructuredOutput:
    return StructuredOutput(message.kind, message.spec, tuple(message.choices), not message.compact_json,
                            message.param or "response_format")


def structured_output_to_proto(structured: StructuredOutput) -> types_pb2.StructuredOutput:
    return types_pb2.StructuredOutput(kind=structured.kind, spec=structured.spec, choices=list(structured.choices),
                                      compact_json=not structured.any_whitespace, param=structured.param)


# vLLM's penalties and min_p: optional floats on the wire (unset: the engine's no-op default).
SAMPLING_FILTER_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def sampling_to_proto(params: SamplingParams) -> types_pb2.SamplingParams:
    """The wire message of these parameters (the inverse of `sampling_from_proto`; a default
    optional stays unset, a seed of None too)."""
    defaults = SamplingParams()
    message = types_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens)
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.num_logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.num_prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    for name in ("steps", "block_length"):
        if getattr(params, name) is not None:
            setattr(message, name, getattr(params, name))
    for name in ("remasking", "retention_ratio", "cfg_scale", *SAMPLING_FILTER_FIELDS):
        value = getattr(params, name)
        if value != getattr(defaults, name):
            setattr(message, name, value)
    return message


def token_logprobs_to_proto(logprobs: TokenLogprobs) -> types_pb2.TokenLogprobs:
    return types_pb2.TokenLogprobs(logprob=logprobs.logprob, top_token_ids=[t for t, _ in logprobs.top],
                                   top_logprobs=[v for _, v in logprobs.top])


def token_logprobs_from_proto(message: types_pb2.TokenLogprobs) -> TokenLogprobs:
    """The record of one token's logprobs (float32 on the wire, as the sampler computes them: exact)."""
    return TokenLogprobs(message.logprob, tuple(zip(message.top_token_ids, message.top_logprobs)))


def service_error(err: InvalidInput) -> InvalidArgument:
    """The core's refusal of a stage as the services' error: INVALID_ARGUMENT on gRPC, 400 over
    HTTP, naming the same field."""
    return InvalidArgument(err.message, param=err.param)
