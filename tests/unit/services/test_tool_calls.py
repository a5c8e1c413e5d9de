"""Tool calling's pure half: tools and tool_choice checked, rendered into the prompt,
forced calls as a JSON schema, and calls parsed from whole and streamed answers."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway import openai_schema as oa
from services.gateway.tool_calls import (
    ToolCallStream,
    ToolChoiceMode,
    forced_schema,
    parse_output,
    parse_tools,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
def test_bad_tools_name_the_parameter(body: dict[str, object], param: str) -> None:
    with pytest.raises(oa.SchemaError) as info:
        parse_tools(body)
    assert info.value.param == param


def test_choices() -> None:
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({"tools": [WEATHER]}).mode is ToolChoiceMode.AUTO  # type: ignore[union-attr]
    named = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert named is not None and named.forced and named.named == "get_time"
    schema = json.loads(forced_schema(named))
    assert schema["properties"]["name"] == {"const": "get_time"}
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert required is not None and len(json.loads(forced_schema(required))["anyOf"]) == 2


def test_chat_request_renders_tools_and_turns() -> None:
    req = oa.parse_chat({
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [WEATHER],
        "tool_choice": "required",
    })  # fmt: skip
    roles = [r for r, _ in req.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert "<tools>" in req.messages[0][1] and "get_weather" in req.messages[0][1]
    assert (
        req.messages[2][1]
        == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    assert req.messages[3][1] == "<tool_response>\nsunny\n</tool_response>"
    assert req.sampling.params.guided.kind != 0 and req.sampling.guided_param == "tools"
    with pytest.raises(oa.SchemaError) as info:
        oa.parse_chat({"messages": [{"role": "user", "content": None}]})
    assert info.value.param == "messages[0].content"


def test_parse_output() -> None:
    auto = parse_tools({"tools": [WEATHER]})
    assert auto is not None
    content, calls = parse_output(
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', auto
    )
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Rome"} and calls[0].id.startswith("call_")
    assert parse_output("<tool_call>{broken</tool_call>", auto) == (
        "<tool_call>{broken</tool_call>",
        [],
    )
    assert parse_output('<tool_call>{"name": "other", "arguments": {}}', auto)[1] == []
    forced = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert forced is not None
    content, calls = parse_output('{"name": "get_weather", "arguments": {"city": "X"}}', forced)
    assert content is None and len(calls) == 1


TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, len(TEXT) - 1), unique=True, max_size=8))
def test_streamed_equals_whole(cuts: list[int]) -> None:
    auto = parse_tools({"tools": [WEATHER]})
    assert auto is not None
    stream = ToolCallStream(auto)
    bounds = [0, *sorted(cuts), len(TEXT)]
    sent = "".join(stream.push(TEXT[a:b]) for a, b in itertools.pairwise(bounds))
    rest, calls = stream.finish()
    content, whole = parse_output(TEXT, auto)
    assert (sent + rest).strip() == content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
