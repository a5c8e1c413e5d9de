"""Replaying a JSONL request trace.

Lifecycle: `parse_trace(lines)` validates every line into a `TraceEntry` (a ValueError
names the line and the field); `trace_requests(entries, synth, rng)` turns them into
`BenchRequest`s, synthesising text for entries that only give a token count.

Schema: one JSON object per line (blank lines are skipped):

| field | type | meaning |
|---|---|---|
| `prompt` | string | raw prompt text (exactly one of `prompt`, `messages`, `prompt_tokens`) |
| `messages` | list of `{"role", "content"}` | a chat, rendered with the model's template |
| `prompt_tokens` | int >= 1 | synthetic text of about this many tokens |
| `max_tokens` | int >= 1, required | tokens to generate |
| `timestamp_s` | number >= 0, optional | arrival time from the trace start; all lines or none |
| `tenant` | string, optional | bookkeeping (the gateway has no tenant field yet) |
| `kind` | string, optional | class label for per-class metrics (default `trace`) |

With timestamps, the replay keeps the trace's arrival gaps (times `trace_time_scale`);
without them, the configured arrival process (Poisson or closed loop) paces the lines.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from loadtest.harness.request_spec import BenchRequest
from loadtest.workloads.prompt_text import TextSynth

_INPUTS = ("prompt", "messages", "prompt_tokens")
_KNOWN = {*_INPUTS, "max_tokens", "timestamp_s", "tenant", "kind"}


@dataclass(frozen=True)
class TraceEntry:
    max_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    prompt_tokens: int | None = None
    timestamp_s: float | None = None
    tenant: str = ""
    kind: str = "trace"


def _positive_int(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def _messages(value: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list")
    out = []
    for m in value:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(f"{where}: each message needs string role and content")
        out.append((m["role"], m["content"]))
    return tuple(out)


def parse_line(line: str, lineno: int) -> TraceEntry:
    where = f"trace line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - _KNOWN)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}")
    given = [k for k in _INPUTS if k in obj]
    if len(given) != 1:
        raise ValueError(f"{where}: exactly one of {list(_INPUTS)} is required, got {given}")
    if "max_tokens" not in obj:
        raise ValueError(f"{where}: max_tokens is required")
    ts = obj.get("timestamp_s")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0):
        raise ValueError(f"{where}: timestamp_s must be a number >= 0, got {ts!r}")
    prompt = obj.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: prompt must be a non-empty string")
    for name in ("tenant", "kind"):
        if not isinstance(obj.get(name, ""), str):
            raise ValueError(f"{where}: {name} must be a string")
    return TraceEntry(
        max_tokens=_positive_int(obj, "max_tokens", where),
        prompt=prompt,
        messages=_messages(obj["messages"], where) if "messages" in obj else None,
        prompt_tokens=(
            _positive_int(obj, "prompt_tokens", where) if "prompt_tokens" in obj else None
        ),
        timestamp_s=None if ts is None else float(ts),
        tenant=obj.get("tenant", ""),
        kind=obj.get("kind", "trace") or "trace",
    )


def parse_trace(lines: Iterable[str]) -> list[TraceEntry]:
    entries = [parse_line(line, i) for i, line in enumerate(lines, 1) if line.strip()]
    if not entries:
        raise ValueError("the trace has no requests")
    stamped = sum(e.timestamp_s is not None for e in entries)
    if stamped not in (0, len(entries)):
        raise ValueError(f"timestamp_s on {stamped} of {len(entries)} lines: all or none")
    return entries


def trace_requests(
    entries: Iterable[TraceEntry], synth: TextSynth, rng: random.Random, time_scale: float = 1.0
) -> list[BenchRequest]:
    """BenchRequests in arrival order; offsets are relative to the earliest timestamp."""
    items = list(entries)
    if items and items[0].timestamp_s is not None:
        items.sort(key=lambda e: e.timestamp_s or 0.0)  # stable: ties keep file order
    start = items[0].timestamp_s if items and items[0].timestamp_s is not None else 0.0
    out = []
    for i, e in enumerate(items):
        prompt = e.prompt
        if e.prompt_tokens is not None:
            prompt = synth.text(rng, e.prompt_tokens)
        at_s = None if e.timestamp_s is None else (e.timestamp_s - start) * time_scale
        out.append(
            BenchRequest(
                request_id=f"t{i}",
                kind=e.kind,
                max_tokens=e.max_tokens,
                prompt=prompt,
                messages=e.messages,
                tenant=e.tenant,
                at_s=at_s,
            )
        )
    return out
