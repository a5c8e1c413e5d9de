"""OpenAI response bodies and SSE chunks, built from the gateway's GenerateResponses.

Lifecycle: the HTTP layer makes one `Answer` per request (its `id` and `created` stay
fixed). Streamed, each gateway message becomes one chunk (`chunk`), with the choice's
`index` (n > 1 interleaves the forks), the text delta, and the tokens' log-probabilities
when asked; the stream ends with the usage chunk when asked. Unstreamed, `Choices`
collects the messages per fork and `whole` builds the body; with best_of > n it keeps
the n forks of highest cumulative log-probability. Log-probabilities are shaped as
OpenAI does: the completions API's `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset` (echo puts the prompt's first, the first with no value), chat's
`content: [{token, logprob, bytes, top_logprobs}]`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2
from services.gateway.openai.schema import OpenAIRequest
from services.gateway.openai.tools.calls import (
    ContentDelta,
    ToolCallDelta,
    ToolCallStream,
    parse_tool_calls,
)

Json = dict[str, Any]

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def usage_body(usage: common_pb2.Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(reason: int) -> str:
    return FINISH_REASONS.get(reason, "stop")


@dataclass(frozen=True)
class TokenText:
    """How a token is shown in log-probability answers: its text (special tokens
    included) and, for chat, its bytes."""

    tokenizer: Tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def entry(self, lp: common_pb2.Logprob) -> Json:
        """A chat `top_logprobs` entry."""
        raw = self.tokenizer.token_bytes(lp.token_id)
        return {
            "token": raw.decode("utf-8", errors="replace"),
            "logprob": lp.logprob,
            "bytes": list(raw),
        }


@dataclass
class Choice:
    """One fork's answer so far (unstreamed)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: int | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.chosen.logprob for lp in self.logprobs)


class Choices:
    """Gateway messages of one unstreamed request, per fork; the prompt's
    log-probabilities and the usage when they arrive."""

    def __init__(self, forks: int) -> None:
        self.forks = [Choice(i) for i in range(forks)]
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[common_pb2.TokenLogprobs] = []
        self.usage = common_pb2.Usage()

    def add(self, msg: gateway_pb2.GenerateResponse) -> None:
        choice = self.forks[msg.index]
        choice.text.append(msg.text)
        choice.token_ids.extend(msg.token_ids)
        choice.logprobs.extend(msg.logprobs)
        if msg.prompt_token_ids:
            self.prompt_token_ids = list(msg.prompt_token_ids)
            self.prompt_logprobs = list(msg.prompt_logprobs)
        if msg.finished:
            choice.finish_reason = msg.finish_reason
        if msg.HasField("usage"):
            self.usage = msg.usage

    def best(self, n: int) -> list[Choice]:
        """The n forks of highest cumulative log-probability (best_of), in that order."""
        if n >= len(self.forks):
            return self.forks
        return sorted(self.forks, key=lambda c: c.cumulative_logprob, reverse=True)[:n]


@dataclass(frozen=True)
class Answer:
    """Builds the response bodies of one request; `id` and `created` stay fixed."""

    req: OpenAIRequest
    model: str
    request_id: str
    tokens: TokenText
    prompt_text: str = ""  # echo: the prompt as the client sent it (or decoded ids)
    created: int = field(default_factory=lambda: int(time.time()))
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.req.chat else "cmpl-") + self.request_id

    def _head(self, obj: str) -> Json:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- unstreamed ------------------------------------------------------------------
    def whole(self, choices: Choices) -> Json:
        picked = choices.best(self.req.sampling.n)
        body = self._head("chat.completion" if self.req.chat else "text_completion")
        body["choices"] = [self._whole_choice(i, c, choices) for i, c in enumerate(picked)]
        body["usage"] = usage_body(choices.usage)
        return body

    def _whole_choice(self, index: int, c: Choice, choices: Choices) -> Json:
        text = "".join(c.text)
        reason = finish_reason(c.finish_reason or common_pb2.FINISH_REASON_STOP)
        out: Json = {"index": index, "finish_reason": reason}
        if self.req.chat:
            out["message"] = {"role": "assistant", "content": text}
            out["logprobs"] = self._chat_logprobs(c.logprobs)
            t = self.req.tools
            if t is not None:
                parsed = parse_tool_calls(text, t.tools, t.forced, parallel=t.parallel)
                if parsed.calls:
                    out["message"] = parsed.message()
                    out["finish_reason"] = parsed.finish_reason
            return out
        echo = self.prompt_text if self.req.sampling.echo else ""
        out["text"] = echo + text
        prompt = (choices.prompt_token_ids, choices.prompt_logprobs) if echo else None
        out["logprobs"] = self._completion_logprobs(c.logprobs, prompt)
        return out

    # -- streamed ----------------------------------------------------------------------
    def chunk(self, msg: gateway_pb2.GenerateResponse, *, first: bool) -> Json:
        """One SSE chunk: a fork's text delta (and its tokens' logprobs); the fork's last
        carries its finish reason. `first`: the fork's first chunk (chat sends the role,
        an echoing completion the prompt)."""
        reason = finish_reason(msg.finish_reason) if msg.finished else None
        choice: Json = {"index": msg.index, "finish_reason": reason}
        if self.req.chat:
            text, calls, tool_reason = self._tool_text(msg)
            delta: Json = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            if tool_reason is not None and msg.finished:
                choice["finish_reason"] = tool_reason
            choice["delta"] = delta
            choice["logprobs"] = self._chat_logprobs(msg.logprobs)
            body = self._head("chat.completion.chunk")
        else:
            echo = first and self.req.sampling.echo
            choice["text"] = (self.prompt_text if echo else "") + msg.text
            prompt = (list(msg.prompt_token_ids), list(msg.prompt_logprobs)) if echo else None
            choice["logprobs"] = self._completion_logprobs(list(msg.logprobs), prompt)
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def _tool_text(
        self, msg: gateway_pb2.GenerateResponse
    ) -> tuple[str, list[dict[str, object]], str | None]:
        """A chat delta's text once tool calls are taken out (held back while one may be
        opening), the tool-call deltas of calls that closed, and the fork's finish reason
        when it made calls."""
        t = self.req.tools
        if t is None:
            return msg.text, [], None
        stream = self._tool_streams.setdefault(
            msg.index, ToolCallStream(t.tools, forced=t.forced, parallel=t.parallel)
        )
        events = stream.feed(msg.text)
        if msg.finished:
            events += stream.finish()
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = [e.to_json() for e in events if isinstance(e, ToolCallDelta)]
        return text, calls, stream.finish_reason

    def usage_chunk(self, usage: common_pb2.Usage) -> Json:
        """The extra last chunk `stream_options.include_usage` asks for: no choices."""
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_body(usage)}

    # -- log-probabilities ---------------------------------------------------------------
    def _chat_logprobs(self, values: Sequence[common_pb2.TokenLogprobs]) -> Json | None:
        if self.req.sampling.logprobs is None:
            return None
        content = []
        for v in values:
            entry = self.tokens.entry(v.chosen)
            entry["top_logprobs"] = [self.tokens.entry(t) for t in v.top]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _completion_logprobs(
        self,
        values: Sequence[common_pb2.TokenLogprobs],
        prompt: tuple[list[int], list[common_pb2.TokenLogprobs]] | None,
    ) -> Json | None:
        """The completions API's logprobs object; `prompt` (echo) goes first: its first
        token has no log-probability (nothing precedes it)."""
        if self.req.sampling.logprobs is None:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if prompt is not None:
            ids, prompt_lps = prompt
            if ids:
                tokens.append(self.tokens.text(ids[0]))
                token_logprobs.append(None)
                tops.append(None)
            self._add_positions(prompt_lps, tokens, token_logprobs, tops)
        self._add_positions(values, tokens, token_logprobs, tops)
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def _add_positions(
        self,
        values: Sequence[common_pb2.TokenLogprobs],
        tokens: list[str],
        token_logprobs: list[float | None],
        tops: list[dict[str, float] | None],
    ) -> None:
        n = self.req.sampling.logprobs or 0
        for v in values:
            tokens.append(self.tokens.text(v.chosen.token_id))
            token_logprobs.append(v.chosen.logprob)
            top = {self.tokens.text(t.token_id): t.logprob for t in v.top[:n]}
            # OpenAI's legacy shape lists the chosen token among the top ones too.
            top.setdefault(tokens[-1], v.chosen.logprob)
            tops.append(top)
