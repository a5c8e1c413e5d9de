"""OpenAI request bodies in, typed requests out; OpenAI response and chunk bodies back.

Lifecycle: the HTTP layer hands a decoded JSON body to `parse_completion` or
`parse_chat`. They check the type of every OpenAI field pdserve honours (the sampling
ones in `sampling`, which builds the engine's `SamplingParams`), refuse the ones it
cannot honour (`UNSUPPORTED`) with a `SchemaError` naming the parameter, and return an
`OpenAIRequest`; `to_client_request` turns that into the gateway's own request (no
protobuf message in between). Limits that depend on the model (context length,
vocabulary, chat roles) are checked afterwards by the gateway's own validation, the
same as for gRPC; `param_for` renames its field names to the OpenAI parameter. While
the request runs, `answer.Answer` turns gateway messages into completion bodies or SSE
chunk bodies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import grpc

from engine.errors import InvalidRequestError
from engine.priority import Priority
from engine.sampling_params import GuidedKind, GuidedSpec
from engine.tokenizer import ChatMessage
from services.gateway.client_request import ClientRequest, InputKind, PromptInput
from services.gateway.models.catalog import Resolved
from services.gateway.openai.sampling import (
    ParamNames,
    Sampling,
    SchemaError,
    get_bool,
    get_int,
    max_tokens_param,
    parse_sampling,
)
from services.gateway.openai.tools.prompt import add_tool_prompt, forced_json_schema, render_message
from services.gateway.openai.tools.request import ToolRequest, parse_tools

__all__ = ["OpenAIRequest", "SchemaError", "parse_chat", "parse_completion"]

Json = dict[str, Any]

#: OpenAI's default for /v1/completions; chat has no limit there, so pdserve picks one.
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 512
MAX_TOKENS_CAP = 2**31 - 1

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
    # KV that failed its checksums on every try (re-prefill spent): a retry will do.
    grpc.StatusCode.DATA_LOSS: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")

#: Parameters pdserve cannot honour: the values that mean "not used", and why not.
UNSUPPORTED: dict[str, tuple[tuple[object, ...], str]] = {
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "functions": ((None, []), "the deprecated functions parameter is not supported: send tools"),
    "function_call": ((None, "none", "auto"), "function_call is not supported: send tool_choice"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
}


@dataclass(frozen=True)
class OpenAIRequest:
    """One validated /v1/completions or /v1/chat/completions request. A completion's
    prompt is text (`prompt`) or token ids (`prompt_token_ids`)."""

    chat: bool
    sampling: Sampling
    model: str = ""
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()
    max_tokens_param: str = "max_tokens"  # the name the client used, for error messages
    tools: ToolRequest | None = None
    stream: bool = False
    include_usage: bool = False

    @property
    def max_tokens(self) -> int:
        return self.sampling.params.max_tokens

    @property
    def names(self) -> ParamNames:
        """The OpenAI parameters behind the gateway's field names, for error messages."""
        s = self.sampling
        return ParamNames(self.chat, self.max_tokens_param, s.guided_param, s.best_of > s.n)


# -- parsing -------------------------------------------------------------------------
def parse_completion(body: object) -> OpenAIRequest:
    obj = _object(body)
    max_tokens = get_int(obj, "max_tokens", 1, MAX_TOKENS_CAP)
    prompt, prompt_ids = _prompt(obj)
    sampling = parse_sampling(
        obj, chat=False, max_tokens=COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    )
    return OpenAIRequest(
        chat=False, sampling=sampling, prompt=prompt, prompt_token_ids=prompt_ids, **_common(obj)
    )


def parse_chat(body: object) -> OpenAIRequest:
    obj = _object(body)
    param = max_tokens_param(obj, chat=True)
    max_tokens = get_int(obj, param, 1, MAX_TOKENS_CAP)
    for name in ("echo", "best_of"):
        if obj.get(name) is not None:
            raise SchemaError(name, "is a /v1/completions parameter, not one of chat")
    sampling = parse_sampling(
        obj, chat=True, max_tokens=CHAT_MAX_TOKENS if max_tokens is None else max_tokens
    )
    tools = parse_tools(obj)
    if tools is not None and tools.forced:
        sampling = _force_call(sampling, tools)
    return OpenAIRequest(
        chat=True,
        sampling=sampling,
        messages=_with_tools(_messages(obj), tools),
        tools=tools,
        max_tokens_param=param,
        **_common(obj),
    )


def _force_call(sampling: Sampling, tools: ToolRequest) -> Sampling:
    """A forced tool call constrains the answer to the call's JSON (so it always parses)."""
    if sampling.guided_param:
        raise SchemaError(
            "tool_choice", f"cannot force a call together with {sampling.guided_param}"
        )
    schema = forced_json_schema(tools.tools, tools.choice)
    try:
        guided = GuidedSpec(GuidedKind.JSON_SCHEMA, schema)
    except InvalidRequestError as exc:
        raise ParamNames(True, guided="tools").refusal(exc) from None
    params = replace(sampling.params, guided=guided)
    return replace(sampling, params=params, guided_param="tools")


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
    stream = get_bool(obj, "stream")
    options = obj.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise SchemaError("stream_options", "must be an object")
    if options is not None and not stream:
        raise SchemaError("stream_options", "only allowed when stream is true")
    include_usage = get_bool(options or {}, "include_usage", "stream_options.include_usage")
    return {"model": model or "", "stream": stream, "include_usage": include_usage}


def _prompt(obj: Mapping[str, object]) -> tuple[str, tuple[int, ...]]:
    """(text, ()) or ("", token ids): a string, a list of token ids, or either of those
    alone in a one-element list."""
    value = obj.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value, ()
    if value is None:
        raise SchemaError("prompt", "is required")
    if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        return "", tuple(value)
    if isinstance(value, list) and value and all(isinstance(s, str | list) for s in value):
        raise SchemaError("prompt", "one prompt per request (batched prompts are not supported)")
    raise SchemaError("prompt", "must be a string or a non-empty list of token ids")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


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
        content = render_message(i, msg, _content(msg, i))
        out.append(("system" if role == "developer" else role, content))
    return tuple(out)


def _with_tools(
    messages: tuple[tuple[str, str], ...], tools: ToolRequest | None
) -> tuple[tuple[str, str], ...]:
    """The tools' signatures in the system message (merged into the client's own)."""
    if tools is None:
        return messages
    out = add_tool_prompt([ChatMessage(r, c) for r, c in messages], tools)
    return tuple((m.role, m.content) for m in out)


def _content(msg: Mapping[str, object], i: int) -> str:
    content = msg.get("content")
    if content is None:
        # Only an assistant turn may have no text (it made tool calls instead).
        if msg.get("role") == "assistant":
            return ""
        raise SchemaError(f"messages[{i}].content", "is required (null only for an assistant)")
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
def to_client_request(
    req: OpenAIRequest, model: Resolved, request_id: str, priority: Priority | None
) -> ClientRequest:
    """The gateway's request for `req`, whose model the front door resolved (`model`),
    asking for class `priority` (None: the key's default)."""
    if req.chat:
        messages = tuple(ChatMessage(r, c) for r, c in req.messages)
        prompt = PromptInput(InputKind.CHAT, messages=messages)
    elif req.prompt_token_ids:
        prompt = PromptInput(InputKind.TOKENS, token_ids=req.prompt_token_ids)
    else:
        prompt = PromptInput(InputKind.TEXT, text=req.prompt)
    return ClientRequest(model, prompt, req.sampling.params, request_id, priority)


def param_for(req: OpenAIRequest, gateway_field: str) -> str:
    """The OpenAI parameter behind a field name of the gateway's validation."""
    return req.names.param_for(gateway_field)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> Json:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def http_for_status(code: grpc.StatusCode) -> tuple[int, str]:
    return HTTP_FOR_STATUS.get(code, SERVER_ERROR)
