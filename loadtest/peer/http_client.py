"""One OpenAI-compatible streaming client for both servers: `/v1/completions` with
`stream`, timed token by token exactly as the gRPC harness times its streams.

Lifecycle: `run_closed(base_url, requests, concurrency, timeout_s)` opens one aiohttp
session, starts `concurrency` users that each take the next request as soon as their
last one ended (a closed loop), and returns one `RequestRecord` per request in send
order (a `PointRun`), with times in seconds from the point's start. Each request is greedy with
`ignore_eos` and `max_tokens`, so both servers generate exactly that many tokens, and
asks for the usage chunk (`stream_options.include_usage`; llama-server sends usage on
its last chunk anyway). Per stream:

- TTFT: send -> the first chunk carrying text; ITL: the gaps between chunks carrying
  text (so a server that put several tokens in one chunk would show fewer, longer gaps:
  `tokens_per_chunk` in the report says whether either did);
- the token counts come from the usage the server reports; a stream that ends without
  exactly `max_tokens` completion tokens is an error (`SHORT`), as is an HTTP status
  other than 200 (`HTTP_<status>`), a dropped connection (`UNAVAILABLE`) or the
  deadline (`DEADLINE_EXCEEDED`). Errors are counted, never retried;
- a server that times its own tokens on the last chunk (llama-server's
  `timings.predicted_per_token_ms`) has that kept too, per request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from loadtest.harness.metrics import RequestRecord
from loadtest.harness.request_spec import BenchRequest


@dataclass(frozen=True)
class SseEvent:
    """One `data:` line of the stream: its text, and its usage when it carries one."""

    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ms_per_token: float | None = None  # the server's own timing (llama-server's `timings`)
    done: bool = False  # `data: [DONE]`


def completion_body(req: BenchRequest) -> dict[str, object]:
    """The request body both servers get: greedy, `ignore_eos`, streamed with usage."""
    if req.prompt is None:
        raise ValueError(f"{req.request_id}: the peer client sends raw prompts only")
    return {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def parse_sse_line(line: bytes | str) -> SseEvent | None:
    """The event of one line of the body; None for blank lines, comments, other fields,
    and a `data:` payload that is not a JSON object."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data:"):
        return None
    payload = text[len("data:") :].strip()
    if payload == "[DONE]":
        return SseEvent(done=True)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    choices = obj.get("choices") or []
    pieces = [c.get("text") or "" for c in choices if isinstance(c, dict)]
    timings = obj.get("timings")
    per_token = timings.get("predicted_per_token_ms") if isinstance(timings, dict) else None
    usage = obj.get("usage")
    return SseEvent(
        text="".join(pieces),
        prompt_tokens=int(usage.get("prompt_tokens") or 0) if isinstance(usage, dict) else None,
        completion_tokens=(
            int(usage.get("completion_tokens") or 0) if isinstance(usage, dict) else None
        ),
        ms_per_token=float(per_token) if isinstance(per_token, int | float) else None,
    )


@dataclass
class _Point:
    """Shared state of one point: the clock, the queue of requests, the records."""

    session: aiohttp.ClientSession
    url: str
    timeout_s: float
    bar: tqdm
    t0: float = field(default_factory=time.perf_counter)
    records: list[RequestRecord] = field(default_factory=list)
    ms_per_token: list[float] = field(default_factory=list)  # the server's own, if it says

    def now(self) -> float:
        return time.perf_counter() - self.t0


def apply_event(rec: RequestRecord, event: SseEvent, now: float, last: float) -> float:
    """Fold one event into the record; returns the time of the last text chunk."""
    if event.text:
        if rec.first_token_s is None:
            rec.first_token_s = now
        else:
            rec.token_gaps_s.append(now - last)
        last = now
    if event.completion_tokens is not None:
        rec.prompt_tokens = event.prompt_tokens or 0
        rec.output_tokens = event.completion_tokens
    return last


async def _send(point: _Point, req: BenchRequest) -> None:
    rec = RequestRecord(request_id=req.request_id, kind=req.kind, sent_s=point.now())
    point.records.append(rec)
    last = 0.0
    try:
        timeout = aiohttp.ClientTimeout(total=point.timeout_s)
        async with point.session.post(point.url, json=completion_body(req),
                                      timeout=timeout) as resp:  # fmt: skip
            if resp.status != 200:
                rec.code, rec.error = f"HTTP_{resp.status}", (await resp.text())[:300]
                return
            async for line in resp.content:
                event = parse_sse_line(line)
                if event is not None:
                    last = apply_event(rec, event, point.now(), last)
                    if event.ms_per_token is not None and event.completion_tokens is not None:
                        point.ms_per_token.append(event.ms_per_token)
        if rec.output_tokens != req.max_tokens:
            rec.code = "SHORT"
            rec.error = f"{rec.output_tokens} of {req.max_tokens} tokens"
    except TimeoutError:
        rec.code, rec.error = "DEADLINE_EXCEEDED", f"no end within {point.timeout_s:g} s"
    except aiohttp.ClientError as exc:
        rec.code, rec.error = "UNAVAILABLE", str(exc)[:300]
    finally:
        rec.finished_s = point.now()
        point.bar.update(1)


async def _user(point: _Point, queue: asyncio.Queue[BenchRequest]) -> None:
    while not queue.empty():
        await _send(point, queue.get_nowait())


@dataclass(frozen=True)
class PointRun:
    records: list[RequestRecord]  # in send order
    ms_per_token: list[float]  # the server's own time per generated token, per request


async def run_closed(
    base_url: str,
    requests: Sequence[BenchRequest],
    concurrency: int,
    timeout_s: float,
    label: str = "",
    progress: bool = True,
) -> PointRun:
    """Every request, `concurrency` streams at a time."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for req in requests:
        queue.put_nowait(req)
    # A connection per request: llama-server closes a streamed response's connection,
    # and a pooled one reused after that fails; both servers pay the same loopback setup.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    bar = tqdm(total=len(requests), desc=label or "peer", unit="req", leave=False,
               disable=not progress, dynamic_ncols=True)  # fmt: skip
    async with aiohttp.ClientSession(connector=connector) as session:
        point = _Point(session, base_url.rstrip("/") + "/v1/completions", timeout_s, bar)
        try:
            await asyncio.gather(*(_user(point, queue) for _ in range(concurrency)))
        finally:
            bar.close()
    return PointRun(point.records, point.ms_per_token)
