"""OpenAI request bodies in, typed requests out; OpenAI response and chunk bodies back.

Lifecycle: the HTTP layer hands a decoded JSON body to `parse_completion` or
`parse_chat`. They check the type of every OpenAI field pdserve honours, refuse the ones
it cannot honour (n > 1, logprobs, tools, penalties, ...) with a `SchemaError` naming the
parameter, and return an `OpenAIRequest`; `to_generate_request` turns that into the
gateway's protobuf request. Limits that depend on the model (context length, vocabulary,
chat roles) are checked afterwards by the gateway's own validation, the same as for
gRPC; `param_for` renames its field names to the OpenAI parameter. While the request
runs, `Answer` turns gateway messages into completion bodies or SSE chunk bodies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import common_pb2, gateway_pb2
from services.gateway.client import build_request

Json = dict[str, Any]

#: OpenAI's default for /v1/completions; chat has no limit there, so pdserve picks one.
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 512
MAX_TOKENS_CAP = 2**31 - 1
SEED_CAP = 2**63

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

#: gRPC status of the shared gateway path -> (HTTP status, OpenAI error type).
HTTP_FOR_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")

#: Parameters pdserve cannot honour: the values that mean "not used", and why not.
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "n": ((None, 1), "only n=1 is supported; send one request per choice"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "logprobs": ((None, False), "logprobs are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not supported"),
    "frequency_penalty": ((None, 0), "frequency_penalty is not supported (send 0)"),
    "presence_penalty": ((None, 0), "presence_penalty is not supported (send 0)"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "tools": ((None, []), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "response_format": ((None, {"type": "text"}), "only the text response format is supported"),
}


class SchemaError(ValueError):
    """A request body OpenAI's schema or pdserve refuses: HTTP 400 naming `param`."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


@dataclass(frozen=True)
class OpenAIRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str = ""
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    max_tokens: int = COMPLETION_MAX_TOKENS
    max_tokens_param: str = "max_tokens"  # the name the client used, for error messages
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stream: bool = False
    include_usage: bool = False


# -- parsing -------------------------------------------------------------------------
def parse_completion(body: object) -> OpenAIRequest:
    obj = _object(body)
    max_tokens = _int(obj, "max_tokens", 1, MAX_TOKENS_CAP)
    return OpenAIRequest(
        chat=False,
        prompt=_prompt(obj),
        max_tokens=COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        **_common(obj),
    )


def parse_chat(body: object) -> OpenAIRequest:
    obj = _object(body)
    param = "max_completion_tokens" if obj.get("max_completion_tokens") is not None else ""
    max_tokens = _int(obj, param or "max_tokens", 1, MAX_TOKENS_CAP)
    return OpenAIRequest(
        chat=True,
        messages=_messages(obj),
        max_tokens=CHAT_MAX_TOKENS if max_tokens is None else max_tokens,
        max_tokens_param=param or "max_tokens",
        **_common(obj),
    )


def _object(body: object) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise SchemaError(None, "the request body must be a JSON object")
    for name, (allowed, why) in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise SchemaError(name, why)
    return body


def _common(obj: Mapping[str, object]) -> Json:
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise SchemaError("model", "must be a string")
    stream = _bool(obj, "stream")
    options = obj.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise SchemaError("stream_options", "must be an object")
    if options is not None and not stream:
        raise SchemaError("stream_options", "only allowed when stream is true")
    include_usage = _bool(options or {}, "include_usage", "stream_options.include_usage")
    temperature = _number(obj, "temperature", 0.0, 2.0)
    top_p = _number(obj, "top_p", 0.0, 1.0)
    return {
        "model": model or "",
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "seed": _int(obj, "seed", 0, SEED_CAP - 1),
        "stop": _stop(obj),
        "stream": stream,
        "include_usage": include_usage,
    }


def _bool(obj: Mapping[str, object], key: str, param: str = "") -> bool:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise SchemaError(param or key, "must be true or false")
    return bool(value)


def _int(obj: Mapping[str, object], key: str, lo: int, hi: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(key, f"must be an integer (got {value!r})")
    if not lo <= value <= hi:
        raise SchemaError(key, f"must be in [{lo}, {hi}] (got {value})")
    return value


def _number(obj: Mapping[str, object], key: str, lo: float, hi: float) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SchemaError(key, f"must be a number (got {value!r})")
    if not lo <= value <= hi:
        raise SchemaError(key, f"must be in [{lo:g}, {hi:g}] (got {value})")
    return float(value)


def _stop(obj: Mapping[str, object]) -> tuple[str, ...]:
    value = obj.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise SchemaError("stop", "must be a string or a list of strings")
    return tuple(stops)


def _prompt(obj: Mapping[str, object]) -> str:
    value = obj.get("prompt")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if value is None:
        raise SchemaError("prompt", "is required")
    if isinstance(value, list) and value and all(isinstance(s, str) for s in value):
        raise SchemaError("prompt", "one prompt per request (batched prompts are not supported)")
    raise SchemaError("prompt", "must be a string (token-id prompts are not supported)")


def _messages(obj: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    value = obj.get("messages")
    if not isinstance(value, list) or not value:
        raise SchemaError("messages", "must be a non-empty list of {role, content} objects")
    out: list[tuple[str, str]] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise SchemaError(f"messages[{i}]", "must be an object with role and content")
        role = msg.get("role")
        if not isinstance(role, str):
            raise SchemaError(f"messages[{i}].role", "must be a string")
        # OpenAI's newer name for the system role.
        out.append(("system" if role == "developer" else role, _content(msg, i)))
    return tuple(out)


def _content(msg: Mapping[str, object], i: int) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(str(t) for t in texts)
    raise SchemaError(
        f"messages[{i}].content", "must be a string or a list of text parts (only text)"
    )


# -- into the gateway, and errors out of it -------------------------------------------
def to_generate_request(req: OpenAIRequest, request_id: str) -> gateway_pb2.GenerateRequest:
    return build_request(
        prompt=None if req.chat else req.prompt,
        messages=list(req.messages) if req.chat else None,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=req.stop,
        model=req.model,
        request_id=request_id,
    )


def param_for(req: OpenAIRequest, gateway_field: str) -> str:
    """The OpenAI parameter behind a field name of the gateway's validation."""
    name = gateway_field.removeprefix("sampling.")
    if name == "max_tokens":
        return req.max_tokens_param
    if (req.chat and name in ("prompt", "input")) or name.startswith("messages"):
        return "messages"
    return name


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> Json:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def http_for_status(code: grpc.StatusCode) -> tuple[int, str]:
    return HTTP_FOR_STATUS.get(code, SERVER_ERROR)


# -- out: bodies and chunks -------------------------------------------------------------
def usage_body(usage: common_pb2.Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(reason: int) -> str:
    return FINISH_REASONS.get(reason, "stop")


@dataclass(frozen=True)
class Answer:
    """Builds the response bodies of one request; `id` and `created` stay fixed."""

    req: OpenAIRequest
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.req.chat else "cmpl-") + self.request_id

    def _head(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: int, usage: common_pb2.Usage) -> Json:
        """The non-streamed body."""
        choice: Json = {"index": 0, "logprobs": None, "finish_reason": finish_reason(reason)}
        if self.req.chat:
            choice["message"] = {"role": "assistant", "content": text}
            body = self._head("chat.completion")
        else:
            choice["text"] = text
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": usage_body(usage)}

    def chunk(self, text: str, reason: int | None = None, *, first: bool = False) -> Json:
        """One SSE chunk with a text delta; the last one carries the finish reason."""
        choice: Json = {
            "index": 0,
            "logprobs": None,
            "finish_reason": None if reason is None else finish_reason(reason),
        }
        if self.req.chat:
            delta: Json = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
            body = self._head("chat.completion.chunk")
        else:
            choice["text"] = text
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: common_pb2.Usage) -> Json:
        """The extra last chunk `stream_options.include_usage` asks for: no choices."""
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_body(usage)}
