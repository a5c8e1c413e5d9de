"""Tool calling for chat: tools into the prompt, calls out of the model's text.

Lifecycle: `parse_tools(body)` checks `tools` and `tool_choice` (SchemaError naming the
parameter) and returns a `ToolRequest`, or None when the request has no tools or says
`tool_choice: none`. `render_message` turns an assistant turn's `tool_calls` and a
`tool` turn's result into the text the model was trained on, and `system_prompt` the
tool signatures. The default model's chat template (SmolLM2) has no tool support, so the
tools go into the system message in the Hermes / Qwen style that small instruct models
know: signatures as JSON inside <tools></tools>, calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

`required` and a named function are forced with structured output: the whole answer is
constrained (`forced_schema`) to the JSON call object itself, without the tags, so the
call always parses; `auto` leaves the model free, and `parse_output` takes the calls it
wrote from the text (a block that does not parse, or names an unknown tool, stays
content). `ToolCallStream` does the same while streaming: text is held back from the
first `<` that may open a call, and calls are sent whole as `delta.tool_calls` when the
answer ends.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.gateway.openai_sampling import SchemaError

MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: Mapping[str, object]


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...]
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    named: str = ""

    @property
    def forced(self) -> bool:
        return self.mode is not ToolChoiceMode.AUTO

    def names(self) -> set[str]:
        return {t.name for t in self.tools}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # compact JSON, as OpenAI sends it

    def delta(self, index: int) -> dict[str, object]:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip

    def message(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


# -- the request ---------------------------------------------------------------------
def parse_tools(obj: Mapping[str, object]) -> ToolRequest | None:
    tools = obj.get("tools")
    choice = obj.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise SchemaError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise SchemaError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    specs = tuple(_tool(i, t) for i, t in enumerate(tools))
    if len({s.name for s in specs}) != len(specs):
        raise SchemaError("tools", "function names must be unique")
    if choice is None or choice == "auto":
        return ToolRequest(specs)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(specs, ToolChoiceMode.REQUIRED)
    name = _named(choice)
    if name not in {s.name for s in specs}:
        raise SchemaError("tool_choice", f"names {name!r}, which is not in tools")
    return ToolRequest(specs, ToolChoiceMode.NAMED, name)


def _tool(i: int, tool: object) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise SchemaError(where, 'must be {"type": "function", "function": {...}}')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise SchemaError(f"{where}.function", "must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SchemaError(f"{where}.function.name", "must match ^[a-zA-Z0-9_-]{1,64}$")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise SchemaError(f"{where}.function.description", "must be a string")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise SchemaError(f"{where}.function.parameters", "must be a JSON schema (an object)")
    return ToolSpec(name, description, parameters)


def _named(choice: object) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)
    ):
        raise SchemaError(
            "tool_choice",
            'must be "auto", "none", "required" or {"type": "function", "function": {"name"}}',
        )
    return name


# -- into the prompt -------------------------------------------------------------------
def system_prompt(request: ToolRequest) -> str:
    signatures = "\n".join(
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
        )
        for t in request.tools
    )
    return (
        "You may call one or more functions to help with the user's request. The "
        f"functions are listed within <tools></tools>:\n<tools>\n{signatures}\n</tools>\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        f'within tags: {OPEN}{{"name": <function-name>, "arguments": <args-object>}}{CLOSE}'
    )


def render_message(i: int, msg: Mapping[str, object], content: str) -> str:
    """The text of an assistant turn with tool calls, or of a tool result."""
    if msg.get("role") == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise SchemaError(f"messages[{i}].tool_call_id", "must be a string")
        return f"<tool_response>\n{content}\n</tool_response>"
    calls = msg.get("tool_calls")
    if calls is None:
        return content
    if not isinstance(calls, list):
        raise SchemaError(f"messages[{i}].tool_calls", "must be a list")
    parts = [content] if content else []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str)):  # fmt: skip
            raise SchemaError(
                f"messages[{i}].tool_calls[{k}]", "must hold function.name and arguments"
            )
        arguments = _json_or_text(str(fn.get("arguments", "{}")))
        parts.append(f"{OPEN}{json.dumps({'name': fn['name'], 'arguments': arguments})}{CLOSE}")
    return "\n".join(parts)


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def forced_schema(request: ToolRequest) -> str:
    """The JSON schema a forced call's whole answer must match: {"name", "arguments"}."""
    tools = [
        t
        for t in request.tools
        if request.mode is ToolChoiceMode.REQUIRED or t.name == request.named
    ]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


# -- out of the answer -------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(text: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    return ToolCall(new_call_id(), str(obj["name"]), json.dumps(arguments, separators=(",", ":")))


def parse_output(text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer."""
    names = request.names()
    if request.forced:
        call = _call(text.strip(), names)
        return (None, [call]) if call else (text, [])
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in BLOCK.finditer(text):
        call = _call(match.group(1).strip(), names)
        if call is None:
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


@dataclass
class ToolCallStream:
    """Streamed text of one choice: content that cannot be part of a call goes out now;
    the rest is held until the end, when `finish` returns the last content and calls."""

    request: ToolRequest
    _held: list[str] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _holding: bool = False

    def push(self, delta: str) -> str:
        self._text.append(delta)
        if self.request.forced or self._holding:
            self._held.append(delta)
            return ""
        at = delta.find("<")
        if at < 0:
            return delta
        self._holding = True
        self._held.append(delta[at:])
        return delta[:at]

    def finish(self) -> tuple[str, list[ToolCall]]:
        held = "".join(self._held)
        content, calls = parse_output("".join(self._text), self.request)
        if not calls:
            return held, []
        sent = len("".join(self._text)) - len(held)
        rest = (content or "")[sent:] if content else ""
        return rest, calls
