from pdserve.v1 import common_pb2 as _common_pb2
from pdserve.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_ACTION_UNSPECIFIED: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_STATUS: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_START: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_PROMOTE: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_ABORT: _ClassVar[RolloutAction]
ROLLOUT_ACTION_UNSPECIFIED: RolloutAction
ROLLOUT_ACTION_STATUS: RolloutAction
ROLLOUT_ACTION_START: RolloutAction
ROLLOUT_ACTION_PROMOTE: RolloutAction
ROLLOUT_ACTION_ABORT: RolloutAction

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "prompt_token_ids", "sampling", "request_id", "priority")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: ChatList
    prompt_token_ids: TokenList
    sampling: _common_pb2.SamplingParams
    request_id: str
    priority: _common_pb2.Priority
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatList, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenList, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ...) -> None: ...

class ChatList(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finished", "finish_reason", "usage", "prefill_worker", "decode_worker", "trace_id", "phases", "index", "logprobs", "prompt_logprobs", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    prefill_worker: str
    decode_worker: str
    trace_id: str
    phases: _containers.RepeatedCompositeFieldContainer[_common_pb2.PhaseTiming]
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., trace_id: _Optional[str] = ..., phases: _Optional[_Iterable[_Union[_common_pb2.PhaseTiming, _Mapping]]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len", "parent")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    parent: str
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("workers", "active_streams", "max_streams", "rollouts")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_worker_pb2.WorkerStats]
    active_streams: int
    max_streams: int
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[_worker_pb2.WorkerStats, _Mapping]]] = ..., active_streams: _Optional[int] = ..., max_streams: _Optional[int] = ..., rollouts: _Optional[_Iterable[_Union[RolloutStatus, _Mapping]]] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("model", "action", "version", "weight", "sticky")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STICKY_FIELD_NUMBER: _ClassVar[int]
    model: str
    action: RolloutAction
    version: str
    weight: float
    sticky: bool
    def __init__(self, model: _Optional[str] = ..., action: _Optional[_Union[RolloutAction, str]] = ..., version: _Optional[str] = ..., weight: _Optional[float] = ..., sticky: _Optional[bool] = ...) -> None: ...

class RolloutWindow(_message.Message):
    __slots__ = ("requests", "errors", "ttft_p90_s", "itl_p90_s")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_S_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_S_FIELD_NUMBER: _ClassVar[int]
    requests: int
    errors: int
    ttft_p90_s: float
    itl_p90_s: float
    def __init__(self, requests: _Optional[int] = ..., errors: _Optional[int] = ..., ttft_p90_s: _Optional[float] = ..., itl_p90_s: _Optional[float] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("model", "stable", "canary", "weight", "sticky", "phase", "reason", "started_ms", "stable_window", "canary_window")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STICKY_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    STABLE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CANARY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    model: str
    stable: str
    canary: str
    weight: float
    sticky: bool
    phase: str
    reason: str
    started_ms: int
    stable_window: RolloutWindow
    canary_window: RolloutWindow
    def __init__(self, model: _Optional[str] = ..., stable: _Optional[str] = ..., canary: _Optional[str] = ..., weight: _Optional[float] = ..., sticky: _Optional[bool] = ..., phase: _Optional[str] = ..., reason: _Optional[str] = ..., started_ms: _Optional[int] = ..., stable_window: _Optional[_Union[RolloutWindow, _Mapping]] = ..., canary_window: _Optional[_Union[RolloutWindow, _Mapping]] = ...) -> None: ...
