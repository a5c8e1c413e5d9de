"""Tools into the prompt (the system message, or a template that takes them), earlier
calls and results into their turns, through the real SmolLM2 tokenizer; a forced call's
JSON schema accepts exactly the calls it should, checked by jsonschema and by the real
grammar engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from engine.grammar import GrammarCompiler
from engine.sampling_params import GuidedKind, GuidedSpec
from engine.tokenizer import ChatMessage, Tokenizer
from services.gateway.openai.sampling import SchemaError
from services.gateway.openai.tools.calls import parse_tool_calls
from services.gateway.openai.tools.prompt import (
    add_tool_prompt,
    forced_json_schema,
    render_message,
    system_prompt,
    template_tools,
)
from services.gateway.openai.tools.request import (
    ToolChoice,
    ToolChoiceMode,
    ToolRequest,
    parse_tools,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY},
}
TIME = {"type": "function", "function": {"name": "get_time"}}
#: Parameters that point into their own $defs: the forced schema must move the pointers.
PLACE = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"at": {"$ref": "#/$defs/Place"}},
    "required": ["at"],
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "km": {"type": "integer"}},
            "required": ["city", "km"],
            "additionalProperties": False,
        }
    },
}
ROUTE = {"type": "function", "function": {"name": "route", "parameters": PLACE}}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def _request(*tools: dict[str, object], choice: object = None) -> ToolRequest:
    req = parse_tools({"tools": list(tools), "tool_choice": choice})
    assert req is not None
    return req


def _assistant_call(name: str, arguments: str) -> dict[str, object]:
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# -- the system message ----------------------------------------------------------------------
def test_tools_merge_into_the_clients_system_message() -> None:
    req = _request(WEATHER, TIME)
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Oslo?")]
    out = add_tool_prompt(msgs, req)
    assert [m.role for m in out] == ["system", "user"] and out[1] == msgs[1]
    assert out[0].content.startswith("Be brief.\n\n# Tools")
    assert out[0].content.endswith(system_prompt(req))
    tools_block = out[0].content.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    # One signature a line, each OpenAI's own shape.
    no_arguments = {"type": "object", "properties": {}}
    time = {"type": "function", "function": {"name": "get_time", "parameters": no_arguments}}
    assert [json.loads(line) for line in tools_block.splitlines()] == [WEATHER, time]


def test_tools_become_the_first_message_without_a_system_one() -> None:
    out = add_tool_prompt([ChatMessage("user", "hi")], _request(WEATHER))
    assert [m.role for m in out] == ["system", "user"]
    assert out[0].content == system_prompt(_request(WEATHER))


def test_no_tools_native_templates_and_choice_none_leave_messages_alone() -> None:
    msgs = [ChatMessage("user", "hi")]
    assert add_tool_prompt(msgs, None) == msgs
    assert add_tool_prompt(msgs, _request(WEATHER), native=True) == msgs
    off = ToolRequest(_request(WEATHER).tools, ToolChoice(ToolChoiceMode.NONE))
    assert add_tool_prompt(msgs, off) == msgs
    assert template_tools(off) is None and template_tools(None) is None
    assert template_tools(_request(WEATHER, TIME)) == [
        t.signature() for t in _request(WEATHER, TIME).tools
    ]


def test_the_instruction_follows_the_choice() -> None:
    auto = system_prompt(_request(WEATHER))
    assert "<tool_call>\n" in auto and "one block per call" in auto and "at most one" not in auto
    single = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False})
    assert single is not None and "Call at most one function." in system_prompt(single)
    named = system_prompt(_request(WEATHER, TIME, choice=NAMED_TIME))
    assert "Call the function get_time now" in named and '{"name": "get_time"' in named
    assert "<tool_call>\n" not in named  # a forced answer is the bare JSON object
    required = system_prompt(_request(WEATHER, TIME, choice="required"))
    assert "Call one of these functions now" in required and "<tool_call>\n" not in required


# -- earlier calls and results -----------------------------------------------------------------
def test_an_assistant_turns_calls_render_as_blocks() -> None:
    msg = _assistant_call("get_weather", '{"city": "Oslo"}')
    text = render_message(1, msg, "")
    assert (
        text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    odd = {"type": "function", "function": {"name": "get_time", "arguments": "not json"}}
    two = {**msg, "tool_calls": [*msg["tool_calls"], odd]}  # type: ignore[misc]
    lines = render_message(1, two, "Checking.").split("\n")
    assert lines[0] == "Checking." and lines.count("<tool_call>") == 2
    assert '{"name": "get_time", "arguments": "not json"}' in lines
    # What we render, the parser reads back as the same call.
    parsed = parse_tool_calls(render_message(1, msg, "Checking."), _request(WEATHER).tools, False)
    assert parsed.content == "Checking.\n"
    assert [(c.name, c.arguments_json) for c in parsed.calls] == [
        ("get_weather", '{"city":"Oslo"}')
    ]


def test_a_tool_result_is_wrapped_unless_the_template_takes_tools() -> None:
    msg = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert render_message(2, msg, "sunny") == "<tool_response>\nsunny\n</tool_response>"
    assert render_message(2, msg, "sunny", native=True) == "sunny"
    assert render_message(0, {"role": "user", "content": "hi"}, "hi") == "hi"


@pytest.mark.parametrize(
    ("msg", "param"),
    [
        ({"role": "user", "tool_calls": []}, "messages[3].tool_calls"),
        ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[3].tool_calls"),
        ({"role": "assistant", "tool_calls": ["get_time"]}, "messages[3].tool_calls[0]"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}],
            },
            "messages[3].tool_calls[0].function.name",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "f"}}]},
            "messages[3].tool_calls[0].type",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "messages[3].tool_calls[0].function.arguments",
        ),
        ({"role": "tool", "tool_call_id": 7}, "messages[3].tool_call_id"),
    ],
)
def test_bad_turns_name_the_place(msg: dict[str, object], param: str) -> None:
    with pytest.raises(SchemaError) as info:
        render_message(3, msg, "")
    assert info.value.param == param


def test_a_conversation_renders_through_the_real_template(model_dir: Path) -> None:
    """Round trip: tools, an assistant call and its result, by SmolLM2's own template."""
    tok = Tokenizer(model_dir)
    assert not tok.takes_tools  # SmolLM2: the gateway writes the tools itself
    req = _request(WEATHER, TIME)
    body = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        _assistant_call("get_weather", '{"city": "Oslo"}'),
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    turns = [
        ChatMessage(str(m["role"]), render_message(i, m, str(m["content"] or "")))
        for i, m in enumerate(body)
    ]
    prompt = tok.render_chat(add_tool_prompt(turns, req, native=tok.takes_tools))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in prompt and '"name": "get_time"' in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    ) in prompt
    assert (
        '<|im_start|>tool\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>' in prompt
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.encode_chat(add_tool_prompt(turns, req)) == tok.encode(prompt)


def test_a_template_that_takes_tools_gets_them(model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer(tmp_path)
    assert tok.takes_tools
    req = _request(WEATHER, TIME)
    msgs = add_tool_prompt([ChatMessage("user", "hi")], req, native=tok.takes_tools)
    assert msgs == [ChatMessage("user", "hi")]
    assert (
        tok.render_chat(msgs, tools=template_tools(req))
        == "TOOLS get_weather;get_time;|[user] hi\n"
    )
    assert tok.render_chat(msgs) == "[user] hi\n"  # no tools: the template leaves them out


# -- forcing a call ----------------------------------------------------------------------------
def test_forced_schemas() -> None:
    named = _request(
        WEATHER, TIME, choice={"type": "function", "function": {"name": "get_weather"}}
    )
    schema = json.loads(forced_json_schema(named.tools, named.choice))
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == {**CITY, "additionalProperties": False}
    assert schema["required"] == ["name", "arguments"] and schema["additionalProperties"] is False
    required = _request(WEATHER, TIME, choice="required")
    options = json.loads(forced_json_schema(required.tools, required.choice))["anyOf"]
    assert [o["properties"]["name"]["const"] for o in options] == ["get_weather", "get_time"]
    assert options[1]["properties"]["arguments"]["type"] == "object"  # no parameters: {}
    with pytest.raises(ValueError):
        forced_json_schema(required.tools, ToolChoice(ToolChoiceMode.AUTO))
    with pytest.raises(ValueError):
        forced_json_schema(required.tools, ToolChoice(ToolChoiceMode.NAMED, "nope"))


GOOD = [
    {"name": "get_weather", "arguments": {"city": "Oslo"}},
    {"name": "get_time", "arguments": {}},
    {"name": "route", "arguments": {"at": {"city": "Rome", "km": 3}}},
]
BAD = [
    {"name": "get_weather", "arguments": {}},  # a required argument missing
    {"name": "get_date", "arguments": {}},  # not a tool
    {"name": "route", "arguments": {"at": {"city": "Rome"}}},  # $defs still enforced
    {"name": "get_time"},  # arguments missing
    {"name": "get_time", "arguments": {}, "extra": 1},
    {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}},  # strict: no extras
    {"name": "get_time", "arguments": {"tz": "UTC"}},  # no parameters: no arguments
]


def test_a_required_call_schema_accepts_exactly_the_calls() -> None:
    req = _request(WEATHER, TIME, ROUTE, choice="required")
    schema = json.loads(forced_json_schema(req.tools, req.choice))
    for call in GOOD:
        jsonschema.validate(call, schema)
    for call in BAD:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)


def test_the_grammar_engine_enforces_the_forced_schema(model_dir: Path) -> None:
    """The spec the gateway will send compiles, and the real matcher takes the token ids
    of a good call to its end and refuses a bad one."""
    tok = Tokenizer(model_dir)
    compiler = GrammarCompiler.of(tok, tok.vocab_size)
    req = _request(WEATHER, TIME, ROUTE, choice="required")
    spec = GuidedSpec(GuidedKind.JSON_SCHEMA, forced_json_schema(req.tools, req.choice))

    def accepted(call: dict[str, object]) -> bool:
        matcher = compiler.matcher(spec).matcher
        ids = tok.encode(json.dumps(call))
        return all(matcher.consume_token(t) for t in ids) and bool(matcher.is_accepting())

    assert all(accepted(c) for c in GOOD)
    assert not any(accepted(c) for c in BAD)


def test_strictness_leaves_what_the_schema_says_alone() -> None:
    open_ended = {
        "type": "object",
        "properties": {
            "tags": {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "additionalProperties": {"type": "integer"},
            },
            "both": {
                "allOf": [
                    {"properties": {"x": {"type": "integer"}}},
                    {"properties": {"y": {"type": "integer"}}},
                ]
            },
            "ref": {"const": {"$ref": "#/not/a/pointer"}, "default": {"properties": {}}},
        },
    }
    named = _request(
        {"type": "function", "function": {"name": "f", "parameters": open_ended}},
        choice={"type": "function", "function": {"name": "f"}},
    )
    arguments = json.loads(forced_json_schema(named.tools, named.choice))["properties"]["arguments"]
    props = arguments["properties"]
    assert arguments["additionalProperties"] is False
    assert props["tags"]["additionalProperties"] == {"type": "integer"}
    assert all("additionalProperties" not in part for part in props["both"]["allOf"])
    assert props["ref"] == open_ended["properties"]["ref"]  # type: ignore[index]
    jsonschema.validate({"tags": {"a": "x", "b": 2}, "both": {"x": 1, "y": 2}}, arguments)
