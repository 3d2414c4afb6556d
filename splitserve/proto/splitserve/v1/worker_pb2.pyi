from splitserve.proto.splitserve.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaseSessionKvRequest(_message.Message):
    __slots__ = ("session_id", "request_id", "max_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    max_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class LeaseSessionKvResponse(_message.Message):
    __slots__ = ("block_ids", "num_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrepareKvRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "num_tokens", "start", "wait_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    num_tokens: int
    start: int
    wait_ms: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., start: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class PrepareKvResponse(_message.Message):
    __slots__ = ("ok", "block_ids", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, ok: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "start", "end", "chunk_tokens", "block_ids")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    start: int
    end: int
    chunk_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("transfer_id", "request_id", "start", "end", "payload", "dtype", "shape", "checksum", "last", "block_ids", "src_worker", "failed", "error")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SRC_WORKER_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    start: int
    end: int
    payload: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    last: bool
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    src_worker: str
    failed: bool
    error: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., payload: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., last: _Optional[bool] = ..., block_ids: _Optional[_Iterable[int]] = ..., src_worker: _Optional[str] = ..., failed: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("ok", "received_tokens", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    received_tokens: int
    error: str
    def __init__(self, ok: _Optional[bool] = ..., received_tokens: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "pool", "fencing_token")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    role: str
    pool: str
    fencing_token: int
    def __init__(self, role: _Optional[str] = ..., pool: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role", "previous_pool", "pool")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_POOL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    previous_role: str
    role: str
    previous_pool: str
    pool: str
    def __init__(self, previous_role: _Optional[str] = ..., role: _Optional[str] = ..., previous_pool: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("deadline_ms",)
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    deadline_ms: int
    def __init__(self, deadline_ms: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("in_flight",)
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    def __init__(self, in_flight: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("prefill_lens", "history_lens", "decode_batch_sizes", "decode_context_lens", "repeats", "mixed_prefill_lens", "mixed_history_lens", "mixed_decode_batch_sizes", "mixed_decode_context_lens")
    PREFILL_LENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    MIXED_PREFILL_LENS_FIELD_NUMBER: _ClassVar[int]
    MIXED_HISTORY_LENS_FIELD_NUMBER: _ClassVar[int]
    MIXED_DECODE_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    MIXED_DECODE_CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    prefill_lens: _containers.RepeatedScalarFieldContainer[int]
    history_lens: _containers.RepeatedScalarFieldContainer[int]
    decode_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    decode_context_lens: _containers.RepeatedScalarFieldContainer[int]
    repeats: int
    mixed_prefill_lens: _containers.RepeatedScalarFieldContainer[int]
    mixed_history_lens: _containers.RepeatedScalarFieldContainer[int]
    mixed_decode_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    mixed_decode_context_lens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prefill_lens: _Optional[_Iterable[int]] = ..., history_lens: _Optional[_Iterable[int]] = ..., decode_batch_sizes: _Optional[_Iterable[int]] = ..., decode_context_lens: _Optional[_Iterable[int]] = ..., repeats: _Optional[int] = ..., mixed_prefill_lens: _Optional[_Iterable[int]] = ..., mixed_history_lens: _Optional[_Iterable[int]] = ..., mixed_decode_batch_sizes: _Optional[_Iterable[int]] = ..., mixed_decode_context_lens: _Optional[_Iterable[int]] = ...) -> None: ...

class ProfileSample(_message.Message):
    __slots__ = ("kind", "l_hist", "l_incr", "batch", "ctx", "seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    L_HIST_FIELD_NUMBER: _ClassVar[int]
    L_INCR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CTX_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    l_hist: int
    l_incr: int
    batch: int
    ctx: int
    seconds: float
    def __init__(self, kind: _Optional[str] = ..., l_hist: _Optional[int] = ..., l_incr: _Optional[int] = ..., batch: _Optional[int] = ..., ctx: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("samples", "engine_kind", "device")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[ProfileSample]
    engine_kind: str
    device: str
    def __init__(self, samples: _Optional[_Iterable[_Union[ProfileSample, _Mapping]]] = ..., engine_kind: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...
