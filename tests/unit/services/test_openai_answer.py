"""OpenAI response bodies and chunks from gateway messages: choices per fork, best_of,
echo, and log-probabilities in the completions and chat shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2
from services.gateway.openai import schema as oa
from services.gateway.openai.answer import Answer, Choices, TokenText

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tokens(model_dir: Path) -> TokenText:
    return TokenText(Tokenizer(model_dir))


def _usage() -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=3)


def _lp(token: int, logprob: float, *top: tuple[int, float]) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        chosen=common_pb2.Logprob(token_id=token, logprob=logprob),
        top=[common_pb2.Logprob(token_id=t, logprob=v) for t, v in top],
        rank=1,
    )


def _msg(text: str, index: int = 0, **kw: object) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text=text, index=index, **kw)  # type: ignore[arg-type]


def test_whole_bodies(tokens: TokenText) -> None:
    text = Answer(oa.parse_completion({"prompt": "p"}), "m", "abc", tokens)
    choices = Choices(1)
    choices.add(_msg("out", finished=True, finish_reason=LENGTH, usage=_usage()))
    body = text.whole(choices)
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "out", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["total_tokens"] == 8
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    req = oa.parse_chat({"messages": [{"role": "user", "content": "q"}]})
    chat = Answer(req, "m", "x", tokens)
    choices = Choices(1)
    choices.add(_msg("h"))
    choices.add(_msg("i", finished=True, finish_reason=STOP, usage=_usage()))
    body = chat.whole(choices)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-x"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_n_choices_and_best_of_keeps_the_most_likely(tokens: TokenText) -> None:
    req = oa.parse_completion({"prompt": "p", "n": 2, "best_of": 3})
    choices = Choices(3)
    for index, logprob in ((0, -3.0), (1, -1.0), (2, -2.0)):
        choices.add(_msg(f"t{index}", index, logprobs=[_lp(5, logprob)]))
        choices.add(_msg("", index, finished=True, finish_reason=STOP))
    body = Answer(req, "m", "id", tokens).whole(choices)
    assert [c["text"] for c in body["choices"]] == ["t1", "t2"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["logprobs"] is None  # best_of asked for them, not the client


def test_completion_logprobs_with_echo(tokens: TokenText) -> None:
    req = oa.parse_completion({"prompt": "Hello world", "logprobs": 1, "echo": True})
    ids = tokens.tokenizer.encode("Hello world")
    assert len(ids) == 2
    first = _msg(
        "!",
        prompt_token_ids=ids,
        prompt_logprobs=[_lp(ids[1], -4.0, (ids[0], -0.5))],
        logprobs=[_lp(17, -0.25, (17, -0.25))],
    )
    choices = Choices(1)
    choices.add(first)
    choices.add(_msg("", finished=True, finish_reason=STOP))
    body = Answer(req, "m", "id", tokens, "Hello world").whole(choices)
    choice = body["choices"][0]
    assert choice["text"] == "Hello world!"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Hello", " world", tokens.text(17)]
    assert lp["token_logprobs"] == [None, -4.0, -0.25]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"Hello": -0.5, " world": -4.0}
    assert lp["text_offset"] == [0, 5, 11]


def test_chat_chunks_logprobs_and_the_usage_chunk(tokens: TokenText) -> None:
    req = oa.parse_chat(
        {
            "messages": [{"role": "user", "content": "q"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 1,
        }
    )
    answer = Answer(req, "m", "id", tokens)
    emoji = tokens.tokenizer.encode(" 😀")
    first = answer.chunk(_msg("He", logprobs=[_lp(emoji[0], -1.5, (emoji[0], -1.5))]), first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    choice = first["choices"][0]
    assert choice["delta"] == {"role": "assistant", "content": "He"}
    entry = choice["logprobs"]["content"][0]
    assert entry["logprob"] == -1.5 and entry["bytes"] == list(b" \xf0\x9f\x98")
    assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
    assert answer.chunk(_msg("llo", 1), first=True)["choices"][0]["index"] == 1
    last = answer.chunk(_msg("", finished=True, finish_reason=STOP), first=False)
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["delta"] == {}
    usage = answer.usage_chunk(_usage())
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert {first["id"], last["id"], usage["id"]} == {"chatcmpl-id"}
    plain = Answer(oa.parse_completion({"prompt": "p", "stream": True}), "m", "id", tokens)
    chunk = plain.chunk(_msg("a"), first=True)
    assert "usage" not in chunk and chunk["choices"][0]["text"] == "a"
    assert chunk["choices"][0]["logprobs"] is None
