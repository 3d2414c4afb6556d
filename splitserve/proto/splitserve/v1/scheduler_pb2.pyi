from splitserve.proto.splitserve.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompletionReport(_message.Message):
    __slots__ = ("request_id", "session_id", "finish_reason", "prompt_tokens", "output_tokens", "ttft_ms", "mean_itl_ms", "e2e_ms", "worker_ids", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    mean_itl_ms: float
    e2e_ms: float
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., mean_itl_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., worker_ids: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStateResponse(_message.Message):
    __slots__ = ("workers", "policy")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_types_pb2.WorkerLoad]
    policy: str
    def __init__(self, workers: _Optional[_Iterable[_Union[_types_pb2.WorkerLoad, _Mapping]]] = ..., policy: _Optional[str] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    params: _containers.ScalarMap[str, str]
    def __init__(self, policy: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("previous_policy", "policy")
    PREVIOUS_POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    previous_policy: str
    policy: str
    def __init__(self, previous_policy: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...
