"""Streaming one completion from a gateway to the terminal (`pdserve up --generate`,
`pdserve generate`): text to stdout as it arrives, the finish line and usage to stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable

import grpc

from pdserve.v1 import common_pb2
from services.cli.timeline import format_timeline
from services.gateway.client import GatewayClient, RequestOptions, build_request


async def stream_completion(
    client: Callable[[], GatewayClient],
    prompt: str,
    *,
    raw: bool,
    trace: bool = False,
    **sampling: object,
) -> int:
    """Stream one completion to stdout; `client` builds the client inside this loop."""
    request = build_request(
        prompt if raw else None,
        RequestOptions(**sampling),  # type: ignore[arg-type]
        messages=None if raw else [("user", prompt)],
    )
    async with client() as gateway:
        try:
            async for msg in gateway.generate(request):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finished:
                    reason = common_pb2.FinishReason.Name(msg.finish_reason)
                    u = msg.usage
                    print(f"\n[{reason}; prompt {u.prompt_tokens}, cached {u.cached_tokens}, "
                          f"completion {u.completion_tokens} tokens]", file=sys.stderr)  # fmt: skip
                    if trace:
                        print(format_timeline(msg), file=sys.stderr)
        except grpc.aio.AioRpcError as exc:
            print(f"\npdserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
