from splitserve.proto.splitserve.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadyRequest(_message.Message):
    __slots__ = ("engine_family",)
    ENGINE_FAMILY_FIELD_NUMBER: _ClassVar[int]
    engine_family: str
    def __init__(self, engine_family: _Optional[str] = ...) -> None: ...

class ReadyResponse(_message.Message):
    __slots__ = ("ready", "reason", "eligible_workers")
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    reason: str
    eligible_workers: int
    def __init__(self, ready: _Optional[bool] = ..., reason: _Optional[str] = ..., eligible_workers: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("session_id", "ttl_s", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: int
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_s: int
    def __init__(self, session_id: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id", "owner")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "slo", "session_id", "priority", "model", "predicted_output_len", "engine_family", "generated_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FAMILY_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    slo: _types_pb2.Slo
    session_id: str
    priority: int
    model: str
    predicted_output_len: int
    engine_family: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., slo: _Optional[_Union[_types_pb2.Slo, _Mapping]] = ..., session_id: _Optional[str] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., predicted_output_len: _Optional[int] = ..., engine_family: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
