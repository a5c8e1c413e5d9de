"""OpenAI bodies -> typed requests -> GenerateRequest, refusals naming the parameter, and
the response/chunk bodies built back from gateway messages."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import common_pb2
from services.gateway import openai_schema as oa


def test_completion_defaults_follow_openai() -> None:
    req = oa.parse_completion({"model": "m", "prompt": "Hello"})
    assert (req.chat, req.prompt, req.model) == (False, "Hello", "m")
    assert req.max_tokens == oa.COMPLETION_MAX_TOKENS
    assert (req.temperature, req.top_p, req.seed, req.stop) == (1.0, 1.0, None, ())
    assert not req.stream and not req.include_usage


def test_completion_fields_reach_the_generate_request() -> None:
    body = {
        "prompt": ["Hi"],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 3,
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "user": "ignored",
        "logprobs": None,
    }
    req = oa.parse_completion(body)
    assert req.stream and req.include_usage
    msg = oa.to_generate_request(req, "rid-1")
    assert msg.WhichOneof("input") == "prompt" and msg.prompt == "Hi"
    assert msg.request_id == "rid-1" and msg.model == ""
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (7, 0.0, 0.5, 3)
    assert list(s.stop) == ["\n"]


def test_chat_messages_parts_roles_and_max_completion_tokens() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "stop": ["x", "y"],
    }
    req = oa.parse_chat(body)
    assert req.messages == (("system", "Be brief."), ("user", "a\nb"), ("assistant", ""))
    assert (req.max_tokens, req.max_tokens_param, req.stop) == (
        9,
        "max_completion_tokens",
        ("x", "y"),
    )
    msg = oa.to_generate_request(req, "r")
    assert [(m.role, m.content) for m in msg.messages.messages] == list(req.messages)
    assert oa.parse_chat({"messages": [{"role": "user", "content": "q"}]}).max_tokens == (
        oa.CHAT_MAX_TOKENS
    )


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (oa.parse_completion, {"prompt": "hi", "n": 2}, "n"),
        (oa.parse_chat, {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
        (oa.parse_completion, {"prompt": "hi", "temperature": 2.5}, "temperature"),
        (oa.parse_completion, {"prompt": "hi", "temperature": "hot"}, "temperature"),
        (oa.parse_completion, {"prompt": "hi", "top_p": -0.1}, "top_p"),
        (oa.parse_completion, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (oa.parse_completion, {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        (oa.parse_completion, {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        (
            oa.parse_chat,
            {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
        (oa.parse_completion, {"prompt": "hi", "seed": -1}, "seed"),
        (oa.parse_completion, {"prompt": "hi", "stop": ["a", 1]}, "stop"),
        (oa.parse_completion, {"prompt": "hi", "stream": "yes"}, "stream"),
        (
            oa.parse_completion,
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            oa.parse_completion,
            {"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        (oa.parse_completion, {"prompt": "hi", "logprobs": 5}, "logprobs"),
        (oa.parse_completion, {"prompt": "hi", "echo": True}, "echo"),
        (oa.parse_completion, {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        (
            oa.parse_chat,
            {"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        (oa.parse_completion, {}, "prompt"),
        (oa.parse_completion, {"prompt": [1, 2, 3]}, "prompt"),
        (oa.parse_completion, {"prompt": ["a", "b"]}, "prompt"),
        (oa.parse_completion, {"prompt": "hi", "model": 3}, "model"),
        (oa.parse_chat, {"messages": []}, "messages"),
        (oa.parse_chat, {"messages": ["hi"]}, "messages[0]"),
        (oa.parse_chat, {"messages": [{"content": "hi"}]}, "messages[0].role"),
        (
            oa.parse_chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_refusals_name_the_parameter(parse: object, body: dict[str, object], param: str) -> None:
    with pytest.raises(oa.SchemaError) as info:
        parse(body)  # type: ignore[operator]
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(oa.SchemaError) as info:
        oa.parse_completion(["prompt"])
    assert info.value.param is None and "JSON object" in str(info.value)


def test_gateway_fields_map_to_openai_params() -> None:
    chat = oa.parse_chat(
        {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 4}
    )
    text = oa.parse_completion({"prompt": "p"})
    assert oa.param_for(chat, "sampling.max_tokens") == "max_completion_tokens"
    assert oa.param_for(text, "sampling.max_tokens") == "max_tokens"
    assert oa.param_for(chat, "prompt") == "messages"
    assert oa.param_for(chat, "messages.role") == "messages"
    assert oa.param_for(text, "prompt") == "prompt"
    assert oa.param_for(text, "sampling.top_p") == "top_p"


def test_status_table_matches_openai_http_codes() -> None:
    expected = {
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.PERMISSION_DENIED: 403,
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
        grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
        grpc.StatusCode.INTERNAL: 500,
    }
    assert {code: oa.http_for_status(code)[0] for code in expected} == expected
    body = oa.error_body("n: no", "invalid_request_error", "n")
    assert body == {
        "error": {"message": "n: no", "type": "invalid_request_error", "param": "n", "code": None}
    }


def _usage() -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=3)


def test_whole_bodies() -> None:
    text = oa.Answer(oa.parse_completion({"prompt": "p"}), "m", "abc")
    body = text.whole("out", common_pb2.FINISH_REASON_LENGTH, _usage())
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "out", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["total_tokens"] == 8
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    chat = oa.Answer(oa.parse_chat({"messages": [{"role": "user", "content": "q"}]}), "m", "x")
    body = chat.whole("hi", common_pb2.FINISH_REASON_STOP, _usage())
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-x"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_chat_chunks_and_the_usage_chunk() -> None:
    req = oa.parse_chat(
        {
            "messages": [{"role": "user", "content": "q"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    answer = oa.Answer(req, "m", "id")
    first = answer.chunk("He", first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert answer.chunk("llo")["choices"][0]["delta"] == {"content": "llo"}
    last = answer.chunk("", common_pb2.FINISH_REASON_STOP)
    assert last["choices"][0] == {
        "index": 0,
        "logprobs": None,
        "finish_reason": "stop",
        "delta": {},
    }
    usage = answer.usage_chunk(_usage())
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert {first["id"], last["id"], usage["id"]} == {"chatcmpl-id"}
    plain = oa.Answer(oa.parse_completion({"prompt": "p", "stream": True}), "m", "id")
    assert "usage" not in plain.chunk("a")
    assert plain.chunk("a")["choices"][0]["text"] == "a"
