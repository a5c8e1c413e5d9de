from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "tenant", "exclude_workers", "need_prefill", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NEED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    need_prefill: bool
    adapter: _common_pb2.Adapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., need_prefill: _Optional[bool] = ..., adapter: _Optional[_Union[_common_pb2.Adapter, _Mapping]] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "address", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("prefill", "decode", "load_lease_ids")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    LOAD_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    prefill: WorkerRef
    decode: WorkerRef
    load_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefill: _Optional[_Union[WorkerRef, _Mapping]] = ..., decode: _Optional[_Union[WorkerRef, _Mapping]] = ..., load_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLoadRequest(_message.Message):
    __slots__ = ("load_lease_ids",)
    LOAD_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    load_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, load_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLoadResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
