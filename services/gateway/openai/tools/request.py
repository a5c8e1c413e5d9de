"""The tools a chat request offers, checked: `tools`, `tool_choice` and
`parallel_tool_calls` into typed values.

Lifecycle: the OpenAI parser calls `parse_tools(body)` once per chat body. It refuses a
malformed tool with a `SchemaError` naming the place (`tools[2].function.name`,
`tool_choice.function.name`, ...) and returns a `ToolRequest`, or None when the request
offers no tools or says `tool_choice: none` (then nothing about tools is rendered or
parsed). The request is immutable and read by `prompt` (into the prompt, and the
schema of a forced call) and `calls` (calls out of the answer).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.gateway.openai.sampling import SchemaError, get_bool

#: OpenAI's own limit on tools per request.
MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: A tool without `parameters` takes no arguments.
NO_PARAMETERS: Mapping[str, object] = {"type": "object", "properties": {}}
CHOICE_SHAPE = 'must be "auto", "none", "required" or {"type": "function", "function": {"name"}}'


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"  # the model decides: text, calls, or both
    NONE = "none"  # no calls: tools are not rendered
    REQUIRED = "required"  # exactly one call to one of the tools (forced)
    NAMED = "named"  # exactly one call to the named function (forced)


@dataclass(frozen=True)
class ToolSpec:
    """One function tool; `parameters_json` is its JSON schema as compact JSON text."""

    name: str
    description: str
    parameters_json: str

    @property
    def parameters(self) -> dict[str, object]:
        out: dict[str, object] = json.loads(self.parameters_json)
        return out

    def signature(self) -> dict[str, object]:
        """The tool in OpenAI's shape, as the prompt (or a chat template) shows it."""
        fn: dict[str, object] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str = ""  # the function, for NAMED

    @property
    def forced(self) -> bool:
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)


@dataclass(frozen=True)
class ToolRequest:
    """The tools one chat request offers and how the model must use them."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True  # parallel_tool_calls: false keeps at most one call

    @property
    def forced(self) -> bool:
        return self.choice.forced

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode is not ToolChoiceMode.NONE


# -- parsing -------------------------------------------------------------------------
def parse_tools(obj: Mapping[str, object]) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body, checked."""
    raw = obj.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise SchemaError("tools", "must be a list of function tools")
    if raw and len(raw) > MAX_TOOLS:
        raise SchemaError("tools", f"must hold at most {MAX_TOOLS} tools (got {len(raw)})")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw or []))
    _check_unique(tools)
    choice = parse_tool_choice(obj.get("tool_choice"), tools)
    parallel = obj.get("parallel_tool_calls") is None or get_bool(obj, "parallel_tool_calls")
    request = ToolRequest(tools, choice, parallel)
    return request if request.active else None


def parse_tool_choice(value: object, tools: Sequence[ToolSpec]) -> ToolChoice:
    """`tool_choice`; absent means auto with tools and none without (OpenAI's defaults)."""
    if value is None:
        return ToolChoice(ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE)
    if value in ("auto", "none", "required"):
        choice = ToolChoice(ToolChoiceMode(value))
    elif isinstance(value, dict):
        choice = ToolChoice(ToolChoiceMode.NAMED, _named(value))
    else:
        raise SchemaError("tool_choice", CHOICE_SHAPE)
    if choice.forced and not tools:
        raise SchemaError("tool_choice", f"{_mode_text(choice)} needs tools")
    if choice.mode is ToolChoiceMode.NAMED and choice.name not in {t.name for t in tools}:
        raise SchemaError("tool_choice.function.name", f"{choice.name!r} is not one of the tools")
    return choice


def _tool(i: int, tool: object) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise SchemaError(where, 'must be {"type": "function", "function": {...}}')
    if tool.get("type") != "function":
        raise SchemaError(f"{where}.type", 'must be "function" (the only tool type)')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise SchemaError(f"{where}.function", "must be an object with name and parameters")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SchemaError(f"{where}.function.name", "must match ^[a-zA-Z0-9_-]{1,64}$")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise SchemaError(f"{where}.function.description", "must be a string")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise SchemaError(f"{where}.function.parameters", "must be a JSON schema (an object)")
    get_bool(fn, "strict", f"{where}.function.strict")  # accepted; forced calls are strict
    text = json.dumps(parameters if parameters else NO_PARAMETERS, separators=(",", ":"))
    return ToolSpec(name, description or "", text)


def _check_unique(tools: Sequence[ToolSpec]) -> None:
    first: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in first:
            raise SchemaError(
                f"tools[{i}].function.name", f"{tool.name!r} is already tools[{first[tool.name]}]"
            )
        first[tool.name] = i


def _named(value: Mapping[str, object]) -> str:
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise SchemaError("tool_choice", CHOICE_SHAPE)
    return name


def _mode_text(choice: ToolChoice) -> str:
    return f"naming {choice.name!r}" if choice.name else f'"{choice.mode.value}"'
