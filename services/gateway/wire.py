"""Requests whose bytes are not a valid message get INVALID_ARGUMENT, not gRPC's UNKNOWN.

gRPC Python parses a request before the servicer runs. When parsing fails (truncated
bytes, a corrupt wire format, a string field that is not UTF-8) it answers UNKNOWN
("Unexpected DecodeError") and logs a traceback for every such message, so any client
sending garbage fills the log with errors. `add_servicer(add_fn, servicer, server)`
registers a generated servicer with a parser that keeps such a failure as a `Malformed`
value instead, and a handler that answers it with INVALID_ARGUMENT naming the message
type before the servicer sees it.

Lifecycle: call `add_servicer` where the generated `add_*Servicer_to_server` would be
called; every method of that service is wrapped (unary-unary and unary-stream, the kinds
pdserve's services have).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse: what it should have been and why it was not."""

    message_type: str
    reason: str

    def details(self) -> str:
        return f"request: not a valid {self.message_type} ({self.reason})"


def _tolerant(parse: Callable[[bytes], Any], message_type: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(message_type, str(exc).split(": ")[-1] or type(exc).__name__)

    return deserialize


def _wrap(handler: grpc.RpcMethodHandler, message_type: str) -> grpc.RpcMethodHandler:
    parse = _tolerant(handler.request_deserializer, message_type)
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
            return await unary(request, context)

        return handler._replace(request_deserializer=parse, unary_unary=unary_unary)
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def unary_stream(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
            # aclosing: closing this stream closes the servicer's at once, not at GC.
            async with contextlib.aclosing(stream(request, context)) as responses:
                async for response in responses:
                    yield response

        return handler._replace(request_deserializer=parse, unary_stream=unary_stream)
    return handler  # client-streaming kinds: left as gRPC builds them


class _Capture:
    """Stands in for the server while a generated `add_*_to_server` registers itself."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: Mapping[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # rebuilt from the registered handlers below

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(
    add_fn: Callable[[Any, Any], None], servicer: object, server: grpc.aio.Server
) -> None:
    """Register `servicer` like `add_fn(servicer, server)`, with malformed requests
    answered INVALID_ARGUMENT."""
    capture = _Capture()
    add_fn(servicer, capture)
    message_types = _request_types(capture.service)
    handlers = {
        name: _wrap(h, message_types.get(name, "request")) for name, h in capture.handlers.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(capture.service, handlers),)
    )
    server.add_registered_method_handlers(capture.service, handlers)


def _request_types(service: str) -> dict[str, str]:
    """Method name -> full name of its request message, from the protobuf registry."""
    from google.protobuf import descriptor_pool

    try:
        desc = descriptor_pool.Default().FindServiceByName(service)
    except KeyError:
        return {}
    return {m.name: m.input_type.full_name for m in desc.methods}
