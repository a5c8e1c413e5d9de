from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "adapter", "cache_weight")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: _common_pb2.Priority
    adapter: _common_pb2.Adapter
    cache_weight: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., adapter: _Optional[_Union[_common_pb2.Adapter, _Mapping]] = ..., cache_weight: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finished", "finish_reason", "kv_handle", "cached_tokens", "worker_id", "phases", "prompt_logprobs", "first_logprobs", "fork_token_ids")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finished: bool
    finish_reason: _common_pb2.FinishReason
    kv_handle: _common_pb2.KvHandle
    cached_tokens: int
    worker_id: str
    phases: _containers.RepeatedCompositeFieldContainer[_common_pb2.PhaseTiming]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    first_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    fork_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_token_id: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., phases: _Optional[_Iterable[_Union[_common_pb2.PhaseTiming, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., first_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., fork_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "kv_handle", "priority", "resume_token_ids", "adapter", "cache_weight")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    kv_handle: _common_pb2.KvHandle
    priority: _common_pb2.Priority
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: _common_pb2.Adapter
    cache_weight: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., kv_handle: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[_Union[_common_pb2.Adapter, _Mapping]] = ..., cache_weight: _Optional[float] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "cached_tokens", "kv_bytes", "phases", "index", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    cached_tokens: int
    kv_bytes: int
    phases: _containers.RepeatedCompositeFieldContainer[_common_pb2.PhaseTiming]
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[_common_pb2.PhaseTiming, _Mapping]]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("previous", "role")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    previous: str
    role: str
    def __init__(self, previous: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "total_blocks", "free_blocks", "used_blocks", "cached_blocks", "held_blocks", "running", "waiting", "active_leases", "expired_leases", "prefix_hit_tokens", "prefix_query_tokens", "kv_layout_fingerprint", "address", "offload_blocks", "offload_capacity_blocks", "lora_adapters", "lora_held")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_HELD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    held_blocks: int
    running: int
    waiting: int
    active_leases: int
    expired_leases: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    kv_layout_fingerprint: str
    address: str
    offload_blocks: int
    offload_capacity_blocks: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_held: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., held_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., active_leases: _Optional[int] = ..., expired_leases: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., kv_layout_fingerprint: _Optional[str] = ..., address: _Optional[str] = ..., offload_blocks: _Optional[int] = ..., offload_capacity_blocks: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_held: _Optional[int] = ...) -> None: ...
