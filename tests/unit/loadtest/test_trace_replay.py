"""JSONL trace parsing and replay order."""

from __future__ import annotations

import json
import random

import pytest

from loadtest.harness.trace import parse_line, parse_trace, trace_requests
from loadtest.workloads.prompt_text import TextSynth

WORDS = [f" t{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}q" for i in range(100)]


def _lines(*objs: object) -> list[str]:
    return [json.dumps(o) for o in objs]


def test_parse_every_input_kind() -> None:
    entries = parse_trace(
        [
            *_lines(
                {"prompt": "hello", "max_tokens": 4, "tenant": "a", "kind": "qa"},
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ),
            "   ",
            *_lines({"prompt_tokens": 30, "max_tokens": 1}),
        ]
    )
    assert [e.kind for e in entries] == ["qa", "trace", "trace"]
    assert entries[0].prompt == "hello" and entries[0].tenant == "a"
    assert entries[1].messages == (("user", "hi"),)
    assert entries[2].prompt_tokens == 30 and entries[2].timestamp_s is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"max_tokens": 3}', "exactly one of"),
        ('{"prompt": "a", "prompt_tokens": 3, "max_tokens": 3}', "exactly one of"),
        ('{"prompt": "a"}', "max_tokens is required"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be"),
        ('{"prompt": "a", "max_tokens": true}', "max_tokens must be"),
        ('{"prompt": "", "max_tokens": 2}', "prompt must be"),
        ('{"prompt": "a", "max_tokens": 2, "timestamp_s": -1}', "timestamp_s"),
        ('{"messages": [{"role": "user"}], "max_tokens": 2}', "role and content"),
        ('{"prompt": "a", "max_tokens": 2, "temperature": 1}', "unknown fields"),
    ],
)
def test_bad_lines_name_the_line_and_field(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_line(line, 7)
    assert "line 7" in str(info.value)


def test_timestamps_all_or_none_and_replay_order() -> None:
    with pytest.raises(ValueError, match="all or none"):
        parse_trace(
            _lines(
                {"prompt": "a", "max_tokens": 1, "timestamp_s": 1.0},
                {"prompt": "b", "max_tokens": 1},
            )
        )
    with pytest.raises(ValueError, match="no requests"):
        parse_trace(["", "  "])
    entries = parse_trace(
        _lines(
            {"prompt": "late", "max_tokens": 1, "timestamp_s": 12.0},
            {"prompt": "first", "max_tokens": 1, "timestamp_s": 10.0},
            {"prompt_tokens": 8, "max_tokens": 1, "timestamp_s": 11.0},
        )
    )
    reqs = trace_requests(entries, TextSynth(WORDS), random.Random(0), time_scale=0.5)
    assert [r.at_s for r in reqs] == [0.0, 0.5, 1.0]
    assert reqs[0].prompt == "first" and reqs[2].prompt == "late"
    assert reqs[1].prompt is not None and len(reqs[1].prompt.split()) == 8
    assert len({r.request_id for r in reqs}) == 3
