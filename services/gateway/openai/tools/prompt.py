"""A chat request's tools into the prompt, and a forced call into the JSON schema that
structured output enforces.

Lifecycle (pure functions, once per request, after `request.parse_tools`):
1. `render_message(i, msg, content)` gives each message's text: an assistant turn's
   `tool_calls` become <tool_call> blocks after its content (content may be null), a
   `tool` turn's result is wrapped in <tool_response>. This runs with or without tools in
   the request (a conversation can carry earlier calls).
2. `add_tool_prompt(messages, request, native=tokenizer.takes_tools)`. A chat template
   that renders tools itself (`Tokenizer.takes_tools`: its text mentions `tools`) gets
   `template_tools(request)` through `Tokenizer.render_chat(..., tools=...)` and the
   messages stay as they are. The default model's (SmolLM2) cannot, so the signatures go
   into the system message, after the client's own system text or as a new first
   message, in the Hermes / Qwen style small instruct models are trained on: one JSON
   signature a line inside <tools></tools>, calls written as
   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.
3. A forced call (`tool_choice` required, or a named function):
   `forced_json_schema(tools, choice)` is the JSON schema of the call object
   `{"name": <const>, "arguments": <the tool's parameters>}` (for `required`, anyOf over
   the tools), strict as OpenAI's `strict: true` reads a schema (an object that lists
   its properties takes no others unless it says so). The whole answer is constrained
   to that object with JSON_SCHEMA guided decoding, without the <tool_call> tags, so a
   forced call always parses (unless `max_tokens` cuts it short), and
   `calls.parse_tool_calls(..., forced=True)` reads the bare object as the call. (A
   Lark grammar could wrap the same schema in the tags with `%json`; that would buy
   nothing a client sees, and a JSON schema is what every guided-decoding engine takes.)
   The prompt tells a forced request to answer with the bare object, so what the model
   expects and what the grammar allows agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from engine.tokenizer import ChatMessage
from services.gateway.openai.sampling import SchemaError
from services.gateway.openai.tools.request import ToolChoice, ToolChoiceMode, ToolRequest, ToolSpec

#: The tags a call is written in, in the prompt and in the model's answer.
OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


# -- into the prompt -----------------------------------------------------------------------
def render_message(i: int, msg: Mapping[str, object], content: str, *, native: bool = False) -> str:
    """The text of `messages[i]` (its plain `content` already read): an assistant turn's
    calls are appended as <tool_call> blocks; a tool result is wrapped in
    <tool_response> unless the template handles tools itself (`native`)."""
    role = msg.get("role")
    calls = msg.get("tool_calls")
    if calls is not None and role != "assistant":
        raise SchemaError(f"messages[{i}].tool_calls", "only an assistant message makes calls")
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise SchemaError(f"messages[{i}].tool_call_id", "must be a string")
        return content if native else f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
    if calls is None:
        return content
    if not isinstance(calls, list):
        raise SchemaError(f"messages[{i}].tool_calls", "must be a list of calls")
    blocks = [_call_text(f"messages[{i}].tool_calls[{k}]", c) for k, c in enumerate(calls)]
    return "\n".join([content, *blocks] if content else blocks)


def _call_text(where: str, call: object) -> str:
    """One earlier call as the model writes it: <tool_call>{"name", "arguments"}</tool_call>."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(fn, dict):
        raise SchemaError(where, 'must be {"id", "type": "function", "function": {...}}')
    if call.get("type", "function") != "function":
        raise SchemaError(f"{where}.type", 'must be "function"')
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise SchemaError(f"{where}.function.name", "must be a non-empty string")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        # OpenAI sends arguments as JSON text; text that is not JSON is shown as a string.
        arguments = _json_or_text(arguments)
    elif not isinstance(arguments, dict):
        raise SchemaError(f"{where}.function.arguments", "must be a JSON string")
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def system_prompt(request: ToolRequest) -> str:
    """The tools section of the system message, for a template without tool support."""
    lines = "\n".join(json.dumps(t.signature(), ensure_ascii=False) for t in request.tools)
    head = (
        "# Tools\n\nYou can call functions to help with the user's request. Their "
        f"signatures are listed inside <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
    )
    call = '{"name": <function-name>, "arguments": <arguments-object>}'
    if request.choice.mode is ToolChoiceMode.NAMED:
        named = json.dumps(request.choice.name)
        return head + (
            f"Call the function {request.choice.name} now. Answer with only a JSON object "
            f'holding its arguments: {{"name": {named}, "arguments": <arguments-object>}}'
        )
    if request.choice.mode is ToolChoiceMode.REQUIRED:
        return head + (
            "Call one of these functions now. Answer with only a JSON object holding its "
            f"name and arguments: {call}"
        )
    limit = "" if request.parallel else "\nCall at most one function."
    return head + (
        "To call a function, write a JSON object with its name and arguments inside "
        f"{OPEN}{CLOSE} tags, one block per call:\n{OPEN}\n{call}\n{CLOSE}{limit}"
    )


def add_tool_prompt(
    messages: Sequence[ChatMessage], request: ToolRequest | None, *, native: bool = False
) -> list[ChatMessage]:
    """The messages to render: with the tools section in the system message, unless there
    are no tools or the template renders them itself (`native`)."""
    if request is None or native or not request.active:
        return list(messages)
    prompt = system_prompt(request)
    if messages and messages[0].role == "system":
        merged = ChatMessage("system", f"{messages[0].content}\n\n{prompt}")
        return [merged, *messages[1:]]
    return [ChatMessage("system", prompt), *messages]


def template_tools(request: ToolRequest | None) -> list[dict[str, object]] | None:
    """`tools` for `Tokenizer.render_chat` when the template renders them itself."""
    if request is None or not request.active:
        return None
    return [t.signature() for t in request.tools]


# -- forcing a call ------------------------------------------------------------------------
def forced_json_schema(tools: Sequence[ToolSpec], choice: ToolChoice) -> str:
    """The JSON schema a forced answer must match: the bare call object. ValueError for a
    choice that forces nothing or names no tool (parse_tools never returns one)."""
    if not choice.forced:
        raise ValueError(f"tool_choice {choice.mode.value} forces no call")
    chosen = [t for t in tools if choice.mode is ToolChoiceMode.REQUIRED or t.name == choice.name]
    if not chosen:
        raise ValueError(f"no tool named {choice.name!r}")
    if len(chosen) == 1:
        return json.dumps(_call_schema(chosen[0], ""))
    return json.dumps({"anyOf": [_call_schema(t, f"/anyOf/{k}") for k, t in enumerate(chosen)]})


def _call_schema(tool: ToolSpec, at: str) -> dict[str, object]:
    """{"name": const, "arguments": parameters} for the call object at JSON pointer `at`."""
    arguments = _strict(tool.parameters, f"{at}/properties/arguments", closed=True)
    if isinstance(arguments, dict):
        arguments.pop("$schema", None)  # only meaningful at a document's root
        arguments.setdefault("type", "object")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


#: Keywords whose value is a map of name -> subschema, one subschema, a list of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _strict(schema: object, at: str, *, closed: bool) -> object:
    """A copy of a parameters schema fit to be enforced inside the call object:
    - every local `$ref` ("#/$defs/...") points into the schema's new place, since it is
      no longer the document's root;
    - an object with `properties` that says nothing about other keys gets
      `additionalProperties: false`, as OpenAI's strict mode reads it: the model cannot
      ramble through invented arguments until `max_tokens` cuts the call short. (Not
      inside `allOf`, whose parts describe one object together.)"""
    if isinstance(schema, list):  # draft-4 tuple `items`
        return [_strict(s, at, closed=closed) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, object] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _strict(v, at, closed=True) for k, v in value.items()}
        elif key in _SCHEMA_ONE:
            out[key] = _strict(value, at, closed=True)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_strict(v, at, closed=key != "allOf") for v in value]
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + at + value[1:]
        else:
            out[key] = value  # const, enum, default, ...: values, not schemas
    if closed and "properties" in out and not any(k in out for k in _OPEN_ENDED):
        out["additionalProperties"] = False
    return out
