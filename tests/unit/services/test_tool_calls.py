"""Calls out of the model's text: whole answers (`parse_tool_calls`) and streamed ones
(`ToolCallStream`), which say the same thing however the text is cut into deltas."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.openai.tools.calls import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    parse_tool_calls,
)
from services.gateway.openai.tools.request import ToolSpec

NO_ARGS = '{"type":"object","properties":{}}'
TOOLS = (ToolSpec("get_weather", "", NO_ARGS), ToolSpec("get_time", "", NO_ARGS))
ID = re.compile(r"call_[0-9a-f]{24}")
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
CALL = f"<tool_call>{ROME}</tool_call>"


def _parse(text: str, *, forced: bool = False, parallel: bool = True) -> ParsedOutput:
    return parse_tool_calls(text, TOOLS, forced, parallel=parallel)


def _calls(out: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments_json) for c in out.calls]


# -- whole answers -----------------------------------------------------------------------------
def test_a_call_after_some_text() -> None:
    out = _parse(f"Let me check. {CALL}")
    assert out.content == "Let me check. "
    assert _calls(out) == [("get_weather", '{"city":"Rome"}')]
    assert ID.fullmatch(out.calls[0].id) and out.finish_reason == "tool_calls"
    assert out.message() == {
        "role": "assistant",
        "content": "Let me check. ",
        "tool_calls": [
            {
                "id": out.calls[0].id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
            }
        ],
    }


def test_text_without_calls_is_content_as_written() -> None:
    for text in ["", "  ", "Hello <b>there</b>", "a <tool_call> b", "x </tool_call>"]:
        out = _parse(text)
        if "<tool_call>" in text:
            assert out.content == text and not out.calls  # a block that is no call stays
        else:
            assert out == ParsedOutput(text, ())
        assert out.finish_reason is None
        assert out.message() == {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    "block",
    [
        CALL,
        f"<tool_call>\n  {ROME}\n</tool_call>",  # whitespace around the object
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>',
        '<tool_call>{"name": "get_weather", "parameters": {"city": "Rome"}}</tool_call>',
        f"<tool_call>{ROME}",  # the answer ended before the closing tag
        f"<tool_call>\n{ROME}\n",
    ],
)
def test_the_forms_a_call_may_take(block: str) -> None:
    out = _parse(block)
    assert out.content is None and _calls(out) == [("get_weather", '{"city":"Rome"}')]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{broken</tool_call>",
        '<tool_call>{"name": "get_date", "arguments": {}}</tool_call>',  # not a tool
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>["get_time"]</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        "<tool_call>" + "[" * 100_000 + "</tool_call>",  # the JSON decoder's recursion
        "<tool_call></tool_call>",
        "<tool_call>",
    ],
)
def test_blocks_that_are_no_call_stay_content(block: str) -> None:
    text = f"Hi {block} there"
    assert _parse(text) == ParsedOutput(text, ())


def test_several_calls_and_the_content_around_them() -> None:
    time = '{"name": "get_time", "arguments": {}}'
    out = _parse(f"\n<tool_call>{time}</tool_call>\n<tool_call>{ROME}</tool_call>\n")
    assert out.content is None  # only whitespace besides the calls: no content
    assert _calls(out) == [("get_time", "{}"), ("get_weather", '{"city":"Rome"}')]
    assert len({c.id for c in out.calls}) == 2
    mixed = _parse(f"A<tool_call>{time}</tool_call>B<tool_call>oops</tool_call>C{CALL}")
    assert mixed.content == "AB<tool_call>oops</tool_call>C" and len(mixed.calls) == 2
    # parallel_tool_calls false: the first call only; the later one is dropped, not content.
    single = _parse(f"A<tool_call>{time}</tool_call>B{CALL}", parallel=False)
    assert single.content == "AB" and _calls(single) == [("get_time", "{}")]


def test_arguments_are_compact_json_text() -> None:
    out = _parse(
        '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Zürich", "n": [1, 2]}}'
    )
    assert out.calls[0].arguments_json == '{"tz":"Europe/Zürich","n":[1,2]}'
    # A lone surrogate escape stays an escape, so the answer can be encoded as UTF-8.
    lone = _parse('<tool_call>{"name": "get_time", "arguments": {"s": "\\ud800"}}')
    assert lone.calls[0].arguments_json == '{"s":"\\ud800"}'
    lone.calls[0].arguments_json.encode("utf-8")


def test_a_forced_answer_is_the_bare_object() -> None:
    out = _parse(f"  {ROME}\n", forced=True)
    assert out.content is None and _calls(out) == [("get_weather", '{"city":"Rome"}')]
    assert _parse(ROME).calls == ()  # unforced, a bare object is text
    cut = '{"name": "get_weather", "argu'  # e.g. max_tokens ended it: content, no call
    assert _parse(cut, forced=True) == ParsedOutput(cut, ())
    assert _calls(_parse(CALL, forced=True)) == [("get_weather", '{"city":"Rome"}')]


def test_a_call_streams_as_two_deltas() -> None:
    call = ToolCall("call_" + "a" * 24, "get_time", "{}")
    first, second = call.deltas(1)
    assert first.to_json() == {
        "index": 1,
        "id": call.id,
        "type": "function",
        "function": {"name": "get_time", "arguments": ""},
    }
    assert second.to_json() == {"index": 1, "function": {"arguments": "{}"}}


# -- streamed answers ---------------------------------------------------------------------------
def _stream(pieces: list[str], *, forced: bool = False, parallel: bool = True) -> list[StreamEvent]:
    stream = ToolCallStream(TOOLS, forced=forced, parallel=parallel)
    events = [e for piece in pieces for e in stream.feed(piece)]
    events += stream.finish()
    reason = "tool_calls" if any(isinstance(e, ToolCallDelta) for e in events) else None
    assert stream.finish_reason == reason
    return events


def _content(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def _streamed_calls(events: list[StreamEvent]) -> list[tuple[str, str]]:
    """(name, arguments) per call, checking the OpenAI shape of the deltas on the way."""
    calls: list[tuple[str, str]] = []
    for e in events:
        if not isinstance(e, ToolCallDelta):
            continue
        if e.id:  # a call's first delta names it; its arguments follow in the next
            assert e.index == len(calls) and ID.fullmatch(e.id) and e.arguments == ""
            calls.append((e.name, ""))
        else:
            assert e.index == len(calls) - 1 and calls[-1][1] == ""
            calls[-1] = (calls[-1][0], e.arguments)
    return calls


def test_text_that_may_open_a_call_is_held_back() -> None:
    stream = ToolCallStream(TOOLS, forced=False)
    assert stream.feed("Hello <tool") == [ContentDelta("Hello ")]
    assert stream.feed("bar> ok") == [ContentDelta("<toolbar> ok")]
    assert stream.feed(" <tool_call>") == [ContentDelta(" ")]
    assert stream.feed('{"name": "get_time", ') == []
    events = stream.feed('"arguments": {}}</tool_call> done')
    # The call goes out when its block closes, not at the end of the answer.
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta, ContentDelta]
    assert events[2] == ContentDelta(" done") and stream.finish_reason == "tool_calls"
    assert stream.finish() == []
    assert stream.finish() == []  # finishing twice is harmless
    with pytest.raises(RuntimeError):
        stream.feed("more")


def test_whitespace_before_only_calls_never_goes_out() -> None:
    stream = ToolCallStream(TOOLS, forced=False)
    assert stream.feed("\n ") == []
    assert _streamed_calls(stream.feed(CALL)) == [("get_weather", '{"city":"Rome"}')]
    assert stream.finish() == []
    assert _stream(["\n", " "]) == [ContentDelta("\n ")]  # no calls: it was the content


def test_a_forced_stream_answers_at_the_end() -> None:
    stream = ToolCallStream(TOOLS, forced=True)
    assert stream.feed(ROME[:10]) == [] and stream.feed(ROME[10:]) == []
    assert _streamed_calls(stream.finish()) == [("get_weather", '{"city":"Rome"}')]
    assert stream.calls[0].name == "get_weather"


SAMPLES = [
    f"Let me check. {CALL}",
    f"{CALL}\n{CALL} and then <tool_call>not json</tool_call> <tool_",
    "a <tool_call b </tool_call> c <<tool_call>{}</tool_call>",
    f"  \n{CALL}  ",
    f"<tool_call>\n{ROME}\n",
    "<tool_call><tool_call>" + ROME + "</tool_call></tool_call>",
    "no calls at all, just < and <t and <tool_cal",
    "",
]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(SAMPLES),
    st.lists(st.integers(0, 200), max_size=12),
    st.booleans(),
    st.booleans(),
)
def test_streamed_equals_whole_for_any_cuts(
    text: str, cuts: list[int], forced: bool, parallel: bool
) -> None:
    _check_stream_matches(text, cuts, forced=forced, parallel=parallel)


FRAGMENTS = [
    *("<tool_call>", "</tool_call>", "<tool_call", "</tool_", "<", "</", "tool_call", "_call>"),
    *(ROME, '{"name": "get_time"}', "{", "}", ">", " ", "\n", "hi"),
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.lists(st.integers(0, 400), max_size=10),
    st.booleans(),
)
def test_streamed_equals_whole_for_any_text(text: str, cuts: list[int], parallel: bool) -> None:
    _check_stream_matches(text, cuts, forced=False, parallel=parallel)


def _check_stream_matches(text: str, cuts: list[int], *, forced: bool, parallel: bool) -> None:
    bounds = [0, *sorted(c for c in cuts if c < len(text)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    events = _stream(pieces, forced=forced, parallel=parallel)
    whole = _parse(text, forced=forced, parallel=parallel)
    assert _content(events) == (whole.content or "")
    assert _streamed_calls(events) == _calls(whole)
    assert all(e.text for e in events if isinstance(e, ContentDelta))  # no empty deltas


def test_a_long_block_fed_a_character_at_a_time() -> None:
    """The closing tag is searched for only in what is new (and across the cut), and the
    block still closes exactly where it should."""
    body = json.dumps({"name": "get_time", "arguments": {"pad": "x" * 20_000}})
    stream = ToolCallStream(TOOLS, forced=False)
    events = [e for ch in f"<tool_call>{body}</tool_call>" for e in stream.feed(ch)]
    assert [c[0] for c in _streamed_calls(events)] == ["get_time"]
    assert stream.finish() == []
