"""`tools`, `tool_choice` and `parallel_tool_calls` checked into typed values; every bad
one is a SchemaError naming the exact place."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.gateway.openai.sampling import SchemaError
from services.gateway.openai.tools.request import (
    MAX_TOOLS,
    NO_PARAMETERS,
    ToolChoice,
    ToolChoiceMode,
    ToolRequest,
    ToolSpec,
    parse_tools,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY},
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NONE = {"parameters": NO_PARAMETERS}


def _fn(**function: object) -> dict[str, object]:
    return {"type": "function", "function": function}


def _named(name: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"name": "x"}}, "tools"),
        ({"tools": [TIME] * (MAX_TOOLS + 1)}, "tools"),
        ({"tools": ["get_time"]}, "tools[0]"),
        ({"tools": [TIME, {"type": "code_interpreter"}]}, "tools[1].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
        ({"tools": [_fn(name="bad name")]}, "tools[0].function.name"),
        ({"tools": [_fn(name="x" * 65)]}, "tools[0].function.name"),
        ({"tools": [_fn(name="")]}, "tools[0].function.name"),
        ({"tools": [_fn()]}, "tools[0].function.name"),
        ({"tools": [TIME, WEATHER, _fn(name="f", description=3)]}, "tools[2].function.description"),
        ({"tools": [_fn(name="f", parameters=[])]}, "tools[0].function.parameters"),
        ({"tools": [_fn(name="f", parameters="{}")]}, "tools[0].function.parameters"),
        ({"tools": [_fn(name="f", strict="yes")]}, "tools[0].function.strict"),
        ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "function": {"name": "get_weather"}},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": _named("get_time")}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": _named("get_time")}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_name_the_place(body: dict[str, object], param: str) -> None:
    with pytest.raises(SchemaError) as info:
        parse_tools(body)
    assert info.value.param == param


def test_no_tools_or_choice_none_means_no_tool_request() -> None:
    assert parse_tools({}) is None
    assert parse_tools({"tools": None, "tool_choice": "auto"}) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    # Tools offered but switched off: still checked, then nothing to do.
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    with pytest.raises(SchemaError):
        parse_tools({"tools": [_fn(name="bad name")], "tool_choice": "none"})


def test_auto_is_the_default_with_tools() -> None:
    req = parse_tools({"tools": [WEATHER, TIME]})
    assert req is not None
    assert req.choice == ToolChoice(ToolChoiceMode.AUTO) and not req.forced and req.parallel
    assert [t.name for t in req.tools] == ["get_weather", "get_time"]
    weather, time = req.tools
    assert weather == ToolSpec(
        "get_weather", "Weather now", json.dumps(CITY, separators=(",", ":"))
    )
    # No parameters: a function of no arguments.
    assert time.description == "" and time.parameters == NO_PARAMETERS
    assert time.signature() == {"type": "function", "function": {"name": "get_time", **NONE}}
    assert weather.signature()["function"] == WEATHER["function"]


def test_forced_choices_and_parallel() -> None:
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert required is not None and required.forced
    assert required.choice == ToolChoice(ToolChoiceMode.REQUIRED)
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": _named("get_time")})
    assert named is not None and named.forced
    assert named.choice == ToolChoice(ToolChoiceMode.NAMED, "get_time")
    single = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False})
    assert single is not None and not single.parallel
    assert parse_tools({"tools": [WEATHER] * 1, "parallel_tool_calls": True}).parallel  # type: ignore[union-attr]


def test_the_limit_is_inclusive() -> None:
    tools = [_fn(name=f"f{i}") for i in range(MAX_TOOLS)]
    req = parse_tools({"tools": tools})
    assert req is not None and len(req.tools) == MAX_TOOLS


def test_values_are_frozen() -> None:
    req = parse_tools({"tools": [WEATHER]})
    assert isinstance(req, ToolRequest)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.parallel = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.tools[0].name = "other"  # type: ignore[misc]
    # Hashable: a request can key a cache of compiled grammars.
    assert hash(req) == hash(parse_tools({"tools": [WEATHER]}))
