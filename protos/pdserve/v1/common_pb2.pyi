from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GuidedKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GUIDED_KIND_UNSPECIFIED: _ClassVar[GuidedKind]
    GUIDED_KIND_JSON_OBJECT: _ClassVar[GuidedKind]
    GUIDED_KIND_JSON_SCHEMA: _ClassVar[GuidedKind]
    GUIDED_KIND_REGEX: _ClassVar[GuidedKind]
    GUIDED_KIND_CHOICE: _ClassVar[GuidedKind]
    GUIDED_KIND_GRAMMAR: _ClassVar[GuidedKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_DEADLINE: _ClassVar[FinishReason]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_SHEDDABLE: _ClassVar[Priority]
    PRIORITY_STANDARD: _ClassVar[Priority]
    PRIORITY_CRITICAL: _ClassVar[Priority]
GUIDED_KIND_UNSPECIFIED: GuidedKind
GUIDED_KIND_JSON_OBJECT: GuidedKind
GUIDED_KIND_JSON_SCHEMA: GuidedKind
GUIDED_KIND_REGEX: GuidedKind
GUIDED_KIND_CHOICE: GuidedKind
GUIDED_KIND_GRAMMAR: GuidedKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_DEADLINE: FinishReason
PRIORITY_UNSPECIFIED: Priority
PRIORITY_SHEDDABLE: Priority
PRIORITY_STANDARD: Priority
PRIORITY_CRITICAL: Priority

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p", "logprobs", "prompt_logprobs", "n", "include_stop_str_in_output", "skip_special_tokens", "guided")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    min_p: float
    logprobs: int
    prompt_logprobs: int
    n: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    guided: GuidedDecoding
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("kind", "spec", "choices")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    kind: GuidedKind
    spec: str
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[GuidedKind, str]] = ..., spec: _Optional[str] = ..., choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Logprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("chosen", "top", "rank")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    chosen: Logprob
    top: _containers.RepeatedCompositeFieldContainer[Logprob]
    rank: int
    def __init__(self, chosen: _Optional[_Union[Logprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[Logprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("field", "limit", "worker_id")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    field: str
    limit: str
    worker_id: str
    def __init__(self, field: _Optional[str] = ..., limit: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "memory_kind", "fingerprint", "compute_dtype", "kernels")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    memory_kind: str
    fingerprint: str
    compute_dtype: str
    kernels: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., memory_kind: _Optional[str] = ..., fingerprint: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., kernels: _Optional[str] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "incarnation", "agent_name", "transfer_address", "block_ids", "num_tokens", "layout_fingerprint", "lease_id", "lease_expiry_unix_ms", "backend", "first_token_id", "request_id", "fork_token_ids", "adapter_digest", "block_checksums")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    incarnation: str
    agent_name: str
    transfer_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout_fingerprint: str
    lease_id: str
    lease_expiry_unix_ms: int
    backend: str
    first_token_id: int
    request_id: str
    fork_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_digest: str
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., agent_name: _Optional[str] = ..., transfer_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_expiry_unix_ms: _Optional[int] = ..., backend: _Optional[str] = ..., first_token_id: _Optional[int] = ..., request_id: _Optional[str] = ..., fork_token_ids: _Optional[_Iterable[int]] = ..., adapter_digest: _Optional[str] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class PhaseTiming(_message.Message):
    __slots__ = ("name", "start_unix_nano", "end_unix_nano", "worker_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    start_unix_nano: int
    end_unix_nano: int
    worker_id: str
    def __init__(self, name: _Optional[str] = ..., start_unix_nano: _Optional[int] = ..., end_unix_nano: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...
