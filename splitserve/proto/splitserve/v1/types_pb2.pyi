from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "steps", "block_length", "remasking", "retention_ratio", "cfg_scale", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "num_logprobs", "structured_output", "num_prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REMASKING_FIELD_NUMBER: _ClassVar[int]
    RETENTION_RATIO_FIELD_NUMBER: _ClassVar[int]
    CFG_SCALE_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    steps: int
    block_length: int
    remasking: str
    retention_ratio: float
    cfg_scale: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    num_logprobs: int
    structured_output: StructuredOutput
    num_prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., steps: _Optional[int] = ..., block_length: _Optional[int] = ..., remasking: _Optional[str] = ..., retention_ratio: _Optional[float] = ..., cfg_scale: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., num_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., num_prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec", "choices", "compact_json", "param")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    COMPACT_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    choices: _containers.RepeatedScalarFieldContainer[str]
    compact_json: bool
    param: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., choices: _Optional[_Iterable[str]] = ..., compact_json: _Optional[bool] = ..., param: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_ms", "itl_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: int
    itl_ms: int
    def __init__(self, ttft_ms: _Optional[int] = ..., itl_ms: _Optional[int] = ...) -> None: ...

class RequestMeta(_message.Message):
    __slots__ = ("request_id", "session_id", "prompt_len", "history_len", "predicted_output_len", "slo", "priority", "arrival_unix_ms", "max_tokens", "bound_worker", "avoid_workers", "engine_family")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LEN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BOUND_WORKER_FIELD_NUMBER: _ClassVar[int]
    AVOID_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FAMILY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    prompt_len: int
    history_len: int
    predicted_output_len: int
    slo: Slo
    priority: int
    arrival_unix_ms: int
    max_tokens: int
    bound_worker: str
    avoid_workers: _containers.RepeatedScalarFieldContainer[str]
    engine_family: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., history_len: _Optional[int] = ..., predicted_output_len: _Optional[int] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., priority: _Optional[int] = ..., arrival_unix_ms: _Optional[int] = ..., max_tokens: _Optional[int] = ..., bound_worker: _Optional[str] = ..., avoid_workers: _Optional[_Iterable[str]] = ..., engine_family: _Optional[str] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("worker_id", "start", "end", "transfer_id", "lazy", "block_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAZY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    start: int
    end: int
    transfer_id: str
    lazy: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., transfer_id: _Optional[str] = ..., lazy: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvSink(_message.Message):
    __slots__ = ("worker_id", "chunk_tokens", "transfer_id", "start", "block_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    chunk_tokens: int
    transfer_id: str
    start: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., transfer_id: _Optional[str] = ..., start: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("request_id", "stage_index", "worker_id", "start", "end", "prompt_token_ids", "generated_token_ids", "sampling", "kv_sources", "kv_sink", "emit", "keep_kv", "slo", "priority", "push_kv", "session")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCES_FIELD_NUMBER: _ClassVar[int]
    KV_SINK_FIELD_NUMBER: _ClassVar[int]
    EMIT_FIELD_NUMBER: _ClassVar[int]
    KEEP_KV_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PUSH_KV_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stage_index: int
    worker_id: str
    start: int
    end: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_sources: _containers.RepeatedCompositeFieldContainer[KvSource]
    kv_sink: KvSink
    emit: bool
    keep_kv: bool
    slo: Slo
    priority: int
    push_kv: bool
    session: SessionHold
    def __init__(self, request_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., worker_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_sources: _Optional[_Iterable[_Union[KvSource, _Mapping]]] = ..., kv_sink: _Optional[_Union[KvSink, _Mapping]] = ..., emit: _Optional[bool] = ..., keep_kv: _Optional[bool] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., priority: _Optional[int] = ..., push_kv: _Optional[bool] = ..., session: _Optional[_Union[SessionHold, _Mapping]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("stages", "policy", "reason", "report_completion", "decision")
    class DecisionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STAGES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORT_COMPLETION_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    policy: str
    reason: str
    report_completion: bool
    decision: _containers.ScalarMap[str, float]
    def __init__(self, stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., report_completion: _Optional[bool] = ..., decision: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "num_prompt_tokens", "num_output_tokens", "first_token_unix_ns", "emitted_unix_ns", "stage_index", "worker_id", "kv_block_ids", "kv_tokens", "logprobs", "prompt_logprobs", "prompt_logprobs_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    EMITTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_unix_ns: int
    emitted_unix_ns: int
    stage_index: int
    worker_id: str
    kv_block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs_start: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., first_token_unix_ns: _Optional[int] = ..., emitted_unix_ns: _Optional[int] = ..., stage_index: _Optional[int] = ..., worker_id: _Optional[str] = ..., kv_block_ids: _Optional[_Iterable[int]] = ..., kv_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs_start: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "role", "engine_kind", "free_blocks", "total_blocks", "block_size", "running", "waiting", "queued_prefill_tokens", "draining", "num_preemptions", "prefix_hit_rate", "updated_unix_ms", "prefix_hit_tokens", "pinned_sessions", "pinned_blocks", "session_history_lost", "pool", "busy_fraction", "length_boundary")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_HISTORY_LOST_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    engine_kind: str
    free_blocks: int
    total_blocks: int
    block_size: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    draining: bool
    num_preemptions: int
    prefix_hit_rate: float
    updated_unix_ms: int
    prefix_hit_tokens: int
    pinned_sessions: int
    pinned_blocks: int
    session_history_lost: int
    pool: str
    busy_fraction: float
    length_boundary: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., engine_kind: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., num_preemptions: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., updated_unix_ms: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., pinned_sessions: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., session_history_lost: _Optional[int] = ..., pool: _Optional[str] = ..., busy_fraction: _Optional[float] = ..., length_boundary: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionHold(_message.Message):
    __slots__ = ("session_id", "ttl_s", "history_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: int
    history_len: int
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[int] = ..., history_len: _Optional[int] = ...) -> None: ...
