"""The worker's wire: its protobuf messages to and from the core's records, in one place.

The servicer (`workers.server`) and the stage call (`workers.stage_call`) speak protobuf only
through these; records shared by every service (sampling, load) convert in `splitserve.wire`.
"""

from __future__ import annotations

import time

from splitserve.core import KvInBlocks, KvSink, StageKey, StageSlo, StageSpec, TokenEvent
from splitserve.core.sequence import SessionHold
from splitserve.proto import types_pb2
from splitserve.wire import sampling_from_proto, token_logprobs_to_proto

DEFAULT_SESSION_PIN_TTL_S = 600.0  # a round that names no TTL (the coordinator always sends its session's)


def stage_key(stage: types_pb2.Stage) -> StageKey:
    return StageKey(stage.request_id, stage.stage_index)


def has_kv_sink(stage: types_pb2.Stage) -> bool:
    """Whether the stage pushes its KV to another worker (a sink naming no worker is none)."""
    return stage.HasField("kv_sink") and bool(stage.kv_sink.worker_id)


def stage_spec_from_proto(stage: types_pb2.Stage, key: StageKey, kv: KvInBlocks | None) -> StageSpec:
    """The core's stage from the wire's, with its incoming KV already resolved to local blocks."""
    sink = None
    if has_kv_sink(stage):
        s = stage.kv_sink
        sink = KvSink(s.worker_id, s.transfer_id, tuple(s.block_ids), s.chunk_tokens, s.start)
    slo = StageSlo(stage.slo.ttft_ms / 1000 or None, stage.slo.itl_ms / 1000 or None)
    return StageSpec(key, tuple(stage.prompt_token_ids), sampling_from_proto(stage.sampling),
                     output_ids=tuple(stage.generated_token_ids), end=stage.end or None, kv=kv, sink=sink,
                     keep_kv=stage.keep_kv, emit=stage.emit, priority=stage.priority, slo=slo,
                     session=session_hold_from_proto(stage))


def session_hold_from_proto(stage: types_pb2.Stage) -> SessionHold | None:
    """The session round this stage ends, if any (its KV is pinned here when it finishes)."""
    if not stage.HasField("session") or not stage.session.session_id:
        return None
    s = stage.session
    return SessionHold(s.session_id, float(s.ttl_s or DEFAULT_SESSION_PIN_TTL_S), s.history_len)


def token_chunk(stage: types_pb2.Stage, event: TokenEvent, worker_id: str, first_token_unix_ns: int,
                kv_block_ids: list[int] | tuple[int, ...] = (), kv_tokens: int = 0) -> types_pb2.TokenChunk:
    """One message of a stage's stream; the last one of a stage kept for a lazy pull names its blocks."""
    return types_pb2.TokenChunk(
        request_id=stage.request_id, token_ids=event.token_ids, text=event.text,
        finish_reason=event.finish_reason or "", num_prompt_tokens=event.num_prompt_tokens,
        num_output_tokens=event.num_output_tokens, first_token_unix_ns=first_token_unix_ns,
        emitted_unix_ns=time.time_ns(), stage_index=stage.stage_index, worker_id=worker_id,
        kv_block_ids=kv_block_ids, kv_tokens=kv_tokens,
        logprobs=[token_logprobs_to_proto(lp) for lp in event.logprobs],
        prompt_logprobs=[token_logprobs_to_proto(lp) for lp in event.prompt_logprobs],
        prompt_logprobs_start=event.prompt_logprobs_start,
    )
