"""OpenAI bodies -> typed requests -> the gateway's ClientRequest, refusals naming the
parameter, and the response/chunk bodies built back from gateway messages."""

from __future__ import annotations

import json

import grpc
import pytest

from engine.sampling_params import GuidedKind
from services.gateway.client_request import InputKind
from services.gateway.models.catalog import Resolved
from services.gateway.openai import schema as oa

#: The front door resolves the model before it builds the request; these tests only read
#: what the body became.
MODEL = Resolved(None, None)  # type: ignore[arg-type]


def test_completion_defaults_follow_openai() -> None:
    req = oa.parse_completion({"model": "m", "prompt": "Hello"})
    assert (req.chat, req.prompt, req.model) == (False, "Hello", "m")
    assert req.max_tokens == oa.COMPLETION_MAX_TOKENS
    s = req.sampling.params
    assert (s.temperature, s.top_p, s.seed is not None, list(s.stop)) == (1.0, 1.0, False, [])
    assert (req.sampling.n, req.sampling.logprobs, req.sampling.echo) == (1, None, False)
    assert not req.stream and not req.include_usage


def test_completion_fields_reach_the_client_request() -> None:
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
    client = oa.to_client_request(req, MODEL, "rid-1", None)
    assert client.prompt.kind is InputKind.TEXT and client.prompt.text == "Hi"
    assert client.request_id == "rid-1" and client.model is MODEL and client.priority is None
    s = client.sampling
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
    assert (req.max_tokens, req.max_tokens_param, list(req.sampling.params.stop)) == (
        9,
        "max_completion_tokens",
        ["x", "y"],
    )
    client = oa.to_client_request(req, MODEL, "r", None)
    assert client.prompt.kind is InputKind.CHAT
    assert [(m.role, m.content) for m in client.prompt.messages] == list(req.messages)
    assert oa.parse_chat({"messages": [{"role": "user", "content": "q"}]}).max_tokens == (
        oa.CHAT_MAX_TOKENS
    )


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (oa.parse_completion, {"prompt": "hi", "n": 17}, "n"),
        (oa.parse_chat, {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        (oa.parse_completion, {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        (oa.parse_completion, {"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
        (oa.parse_chat, {"messages": [{"role": "user", "content": "q"}], "echo": True}, "echo"),
        (oa.parse_completion, {"prompt": "hi", "logprobs": 21}, "logprobs"),
        (oa.parse_completion, {"prompt": "hi", "logprobs": True}, "logprobs"),
        (
            oa.parse_chat,
            {"messages": [{"role": "user", "content": "q"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (oa.parse_completion, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        (oa.parse_completion, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        (oa.parse_completion, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        (oa.parse_completion, {"prompt": "hi", "logit_bias": [1]}, "logit_bias"),
        (oa.parse_completion, {"prompt": "hi", "min_p": 2}, "min_p"),
        (oa.parse_completion, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        (oa.parse_completion, {"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
        (
            oa.parse_completion,
            {"prompt": "hi", "response_format": {"type": "xml"}},
            "response_format",
        ),
        (
            oa.parse_completion,
            {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
        (oa.parse_completion, {"prompt": "hi", "guided_choice": "a"}, "guided_choice"),
        (
            oa.parse_completion,
            {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]},
            "guided_choice",
        ),
        (oa.parse_completion, {"prompt": "hi", "guided_json": "{"}, "guided_json"),
        (oa.parse_completion, {"prompt": "hi", "suffix": "x"}, "suffix"),
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
        (oa.parse_completion, {"prompt": "hi", "seed": 2**64}, "seed"),
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
        (oa.parse_completion, {}, "prompt"),
        (oa.parse_completion, {"prompt": [1, -2, 3]}, "prompt"),
        (oa.parse_completion, {"prompt": []}, "prompt"),
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


def test_new_sampling_parameters_reach_the_sampling_params() -> None:
    body = {
        "prompt": [1, 2, 3],
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100, "9": 5.5},
        "min_tokens": 2,
        "min_p": 0.1,
        "top_k": -1,
        "ignore_eos": True,
        "stop_token_ids": [4, 5],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "n": 2,
        "best_of": 3,
        "logprobs": 2,
        "echo": True,
        "seed": -1,
    }
    req = oa.parse_completion(body)
    s = req.sampling.params
    assert req.prompt_token_ids == (1, 2, 3) and req.prompt == ""
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens) == (0.5, -1.0, 2)
    assert dict(s.logit_bias) == {7: -100.0, 9: 5.5}
    assert (s.ignore_eos, list(s.stop_token_ids), s.include_stop_str_in_output) == (
        True,
        [4, 5],
        True,
    )
    assert not s.skip_special_tokens and s.top_k == 0  # -1: off
    assert (req.sampling.n, req.sampling.best_of, s.n) == (2, 3, 3)
    assert (s.logprobs, s.prompt_logprobs, req.sampling.echo) == (2, 2, True)
    assert s.seed == 2**63 - 1
    client = oa.to_client_request(req, MODEL, "r", None)
    assert client.prompt.kind is InputKind.TOKENS and client.prompt.token_ids == (1, 2, 3)


def test_best_of_without_logprobs_asks_for_them_quietly() -> None:
    req = oa.parse_completion({"prompt": "p", "best_of": 2})
    assert req.sampling.params.logprobs == 0 and req.sampling.logprobs is None


def test_chat_logprobs_and_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = oa.parse_chat(
        {
            "messages": [{"role": "user", "content": "q"}],
            "logprobs": True,
            "top_logprobs": 3,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
    )
    g = req.sampling.params.guided
    assert g is not None and g.kind is GuidedKind.JSON_SCHEMA and json.loads(g.spec) == schema
    assert req.sampling.logprobs == 3 and req.sampling.guided_param == "response_format"
    assert oa.param_for(req, "sampling.guided.spec") == "response_format"
    assert oa.param_for(req, "sampling.logprobs") == "top_logprobs"
    obj = oa.parse_chat(
        {"messages": [{"role": "user", "content": "q"}], "response_format": {"type": "json_object"}}
    )
    assert obj.sampling.params.guided.kind is GuidedKind.JSON_OBJECT
    choice = oa.parse_completion({"prompt": "p", "structured_outputs": {"choice": ["yes", "no"]}})
    assert list(choice.sampling.params.guided.choices) == ["yes", "no"]
    assert choice.sampling.guided_param == "structured_outputs"
    text = oa.parse_completion({"prompt": "p", "response_format": {"type": "text"}})
    assert text.sampling.params.guided is None


def test_chat_request_renders_tools_and_turns() -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    req = oa.parse_chat(
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [weather],
            "tool_choice": "required",
        }
    )
    assert [r for r, _ in req.messages] == ["system", "user", "assistant", "tool"]
    assert "<tools>" in req.messages[0][1] and "get_weather" in req.messages[0][1]
    assert "<tool_call>" in req.messages[2][1] and "Oslo" in req.messages[2][1]
    assert "<tool_response>" in req.messages[3][1] and "sunny" in req.messages[3][1]
    assert req.sampling.params.guided.kind is GuidedKind.JSON_SCHEMA
    assert req.sampling.guided_param == "tools"
    with pytest.raises(oa.SchemaError) as info:
        oa.parse_chat({"messages": [{"role": "user", "content": None}]})
    assert info.value.param == "messages[0].content"
