"""Tool calls out of the model's text, from a whole answer or a stream of deltas.

Lifecycle: once an answer is complete, `parse_tool_calls(text, tools, forced)` splits it
into content and calls; while it streams, one `ToolCallStream` per choice is fed each
text delta (`feed`) and flushed once at the end (`finish`), and the events it returns,
joined, say exactly what `parse_tool_calls` says of the whole text, however the text was
cut into deltas. The prompt side (tools into the prompt, forced calls as a JSON schema)
is `prompt`.

What counts as a call: a `<tool_call>` block, up to the first `</tool_call>` or the end
of the answer, holding a JSON object `{"name": <one of the tools>, "arguments": <object,
or JSON text of one>}` (whitespace around it is fine). When the request forced a call
(`tool_choice` required or a named function) the answer was constrained to the bare
object, which is then the one call. Anything else stays content, a block that does not
parse or names an unknown tool included, so a parse never raises and never loses text.
With calls made, content that is only whitespace is None; without, the content is the
text as written. `parallel_tool_calls: false` keeps the first call and drops later ones.
An answer that made calls finishes with reason "tool_calls" (`finish_reason`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.openai.tools.prompt import CLOSE, OPEN
from services.gateway.openai.tools.request import ToolSpec

__all__ = [
    "ContentDelta",
    "ParsedOutput",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "parse_tool_calls",
    "read_call",
]

TOOL_CALLS = "tool_calls"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ContentDelta:
    """Text for `delta.content`."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of `delta.tool_calls`: the first of a call names it (`id` set, empty
    arguments), the second carries its whole arguments."""

    index: int
    arguments: str
    id: str = ""
    name: str = ""

    def to_json(self) -> dict[str, object]:
        if not self.id:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


StreamEvent = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # compact JSON text, as OpenAI sends arguments

    def to_json(self) -> dict[str, object]:
        """The call as an entry of a message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }

    def deltas(self, index: int) -> tuple[ToolCallDelta, ToolCallDelta]:
        return (
            ToolCallDelta(index, "", self.id, self.name),
            ToolCallDelta(index, self.arguments_json),
        )


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ToolCall, ...]

    @property
    def finish_reason(self) -> str | None:
        """ "tool_calls" when calls were made; None keeps the engine's own reason."""
        return TOOL_CALLS if self.calls else None

    def message(self) -> dict[str, object]:
        """The answer's `message` object."""
        out: dict[str, object] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [c.to_json() for c in self.calls]
        return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def read_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """The call a block (or a forced answer) holds, or None if it is not one."""
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    # Some small models write "parameters" (the schema's key) for the arguments.
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], _compact(arguments))


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: clients could not read them


def _compact(value: object) -> str:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a "\\ud800" escape: keep it escaped
        return json.dumps(value, separators=(",", ":"))
    return text


def parse_tool_calls(
    text: str, tools: Sequence[ToolSpec], forced: bool, *, parallel: bool = True
) -> ParsedOutput:
    """A whole answer's content and calls."""
    names = frozenset(t.name for t in tools)
    if forced:
        call = read_call(text, names)
        if call is not None:
            return ParsedOutput(None, (call,))
    limit = None if parallel else 1
    calls: list[ToolCall] = []
    content: list[str] = []
    at = 0
    for block in BLOCK.finditer(text):
        content.append(text[at : block.start()])
        at = block.end()
        call = read_call(block.group(1), names)
        if call is None:
            content.append(block.group(0))
        elif limit is None or len(calls) < limit:
            calls.append(call)
    content.append(text[at:])
    return _parsed("".join(content), calls)


def _parsed(content: str, calls: list[ToolCall]) -> ParsedOutput:
    return ParsedOutput(None if calls and not content.strip() else content, tuple(calls))


class ToolCallStream:
    """One streamed choice's text -> content deltas and tool-call deltas.

    Outside a block, text goes out at once except a tail that could still become
    `<tool_call>`; inside one, text is kept until the block closes, and then goes out as a
    call's two deltas (or, if it is no call, as content). Content that is only
    whitespace so far is held too: if the answer turns out to be only calls, it was never
    content. A forced answer is kept whole and read at `finish`. Not thread-safe: one
    reader per stream.
    """

    def __init__(self, tools: Sequence[ToolSpec], *, forced: bool, parallel: bool = True) -> None:
        self._names = frozenset(t.name for t in tools)
        self._tools = tuple(tools)
        self._forced = forced
        self._parallel = parallel
        self._outside = ""  # undecided text outside a block: a tail that may open one
        self._block: str | None = None  # the open block's text after <tool_call>
        self._searched = 0  # how much of _block is known to hold no </tool_call>
        self._space = ""  # whitespace-only content not yet sent
        self._sent = False  # content other than whitespace has gone out
        self._calls: list[ToolCall] = []
        self._whole: list[str] = []  # a forced answer, read at finish
        self._finished = False

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._calls)

    @property
    def finish_reason(self) -> str | None:
        """ "tool_calls" once a call has gone out; None keeps the engine's own reason."""
        return TOOL_CALLS if self._calls else None

    def feed(self, delta: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("ToolCallStream.feed after finish")
        if self._forced:
            self._whole.append(delta)
            return []
        if self._block is None:
            self._outside += delta
        else:
            self._block += delta
        out: list[StreamEvent] = []
        self._scan(out, final=False)
        return out

    def finish(self) -> list[StreamEvent]:
        """The rest, once the answer has ended (a block left open is read as it is)."""
        if self._finished:
            return []
        self._finished = True
        out: list[StreamEvent] = []
        if self._forced:
            parsed = parse_tool_calls(
                "".join(self._whole), self._tools, True, parallel=self._parallel
            )
            self._calls = list(parsed.calls)
            if parsed.content:
                out.append(ContentDelta(parsed.content))
            for i, call in enumerate(parsed.calls):
                out.extend(call.deltas(i))
            return out
        self._scan(out, final=True)
        if self._space and not self._calls:
            out.append(ContentDelta(self._space))
        self._space = ""
        return out

    def _scan(self, out: list[StreamEvent], *, final: bool) -> None:
        while True:
            if self._block is None:
                at = self._outside.find(OPEN)
                if at < 0:
                    keep = 0 if final else _open_prefix(self._outside)
                    cut = len(self._outside) - keep
                    self._content(self._outside[:cut], out)
                    self._outside = self._outside[cut:]
                    return
                self._content(self._outside[:at], out)
                self._block, self._searched = self._outside[at + len(OPEN) :], 0
                self._outside = ""
                continue
            end = self._block.find(CLOSE, self._searched)
            if end < 0:
                self._searched = max(0, len(self._block) - len(CLOSE) + 1)
                if final:
                    self._close(self._block, OPEN + self._block, out)
                    self._block = None
                return
            body, self._outside = self._block[:end], self._block[end + len(CLOSE) :]
            self._block = None
            self._close(body, OPEN + body + CLOSE, out)

    def _close(self, body: str, raw: str, out: list[StreamEvent]) -> None:
        call = read_call(body, self._names)
        if call is None:
            self._content(raw, out)
        elif self._parallel or not self._calls:
            out.extend(call.deltas(len(self._calls)))
            self._calls.append(call)

    def _content(self, text: str, out: list[StreamEvent]) -> None:
        if not text:
            return
        if self._sent:
            out.append(ContentDelta(text))
            return
        self._space += text
        if self._space.strip():
            out.append(ContentDelta(self._space))
            self._space, self._sent = "", True


def _open_prefix(text: str) -> int:
    """The length of the longest tail of `text` that `<tool_call>` starts with."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
