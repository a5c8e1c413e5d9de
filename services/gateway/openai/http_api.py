"""The OpenAI-compatible HTTP front door, served by the gateway process beside gRPC.

Lifecycle: `HttpApi(service).start(host, port)` binds an aiohttp server on the gateway's
event loop and returns the bound address. Each /v1/completions or /v1/chat/completions
body is parsed by `schema` into the gateway's GenerateRequest and goes down the
same path as gRPC Generate (`GatewayService.stream`: validation, tokenization, the
stream cap, placement, `RequestStream`). The handler waits for the first message before
it answers, so every failure before token 1 gets its own HTTP status; a streamed answer
then writes SSE chunks and `data: [DONE]`, and a failure after that is sent as one last
`data: {"error": ...}` event. Errors get the HTTP status of their gRPC status (one
table: `services.common.status`, then `schema.http_for_status`). The
`x-pdserve-priority` header asks for a priority class (400 naming the header if no class
has that name; 403 above the key's highest). A client that disconnects gets its handler
task cancelled (`handler_cancellation`), and the stream's generator is always closed,
which runs the request record's cleanup (decode stream cancelled, un-pulled prefill lease
aborted, load and quota given back). An SSE stream writes each event through small
socket and transport buffers and waits for them to drain, so a client that stops reading
holds the handler within a few KiB; the request's `StreamBuffer` then gives up on it
(`SseDisconnect`). `stop()` stops accepting and gives open requests the drain time to
finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping

import grpc
from aiohttp import web

from engine.errors import InvalidRequestError
from engine.priority import Priority
from pdserve.v1 import gateway_pb2
from services.common.status import (
    AuthError,
    NoWorkerError,
    Refusal,
    StatusError,
    UnknownModelError,
    code_for,
)
from services.gateway.access.auth import Principal
from services.gateway.models.catalog import ModelCard
from services.gateway.models.served_model import ServedModel
from services.gateway.openai import schema as oa
from services.gateway.openai.answer import Answer, Choices, TokenText
from services.gateway.openai.json_body import read_json
from services.gateway.openai.serving_routes import OPEN_PATHS, ServingRoutes
from services.gateway.service import REFUSAL_REASON_KEY, GatewayService

log = logging.getLogger(__name__)

#: The gateway takes prompts up to 1M characters; JSON escaping can double their bytes.
MAX_BODY_BYTES = 8 << 20
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
PRIORITY_HEADER = "x-pdserve-priority"
#: An SSE stream's socket and transport buffers hold about this many bytes per buffered
#: message (a token event is ~200). The kernel would otherwise grow a socket's send
#: buffer to megabytes, thousands of events a client that stopped reading never sees.
EVENT_BYTES = 256
MIN_SOCKET_BUFFER = 4096
#: After giving up on a client: how long the error event may take to leave before the
#: connection is dropped.
CLOSE_GRACE_S = 2.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PRINCIPAL = web.RequestKey("principal", Principal)  # set by the auth middleware
Messages = AsyncGenerator[gateway_pb2.GenerateResponse, None]


def _dumps(body: oa.Json) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _json(status: int, body: oa.Json) -> web.Response:
    return web.json_response(body, status=status, dumps=_dumps)


def _failure(exc: Exception, req: oa.OpenAIRequest) -> tuple[int, oa.Json]:
    """The HTTP status and OpenAI error body of a failed request; re-raises the unknown."""
    if isinstance(exc, oa.SchemaError):
        return 400, oa.error_body(str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, UnknownModelError):
        status, kind = oa.http_for_status(code_for(exc))
        return status, oa.error_body(str(exc), kind, "model", "model_not_found")
    if isinstance(exc, InvalidRequestError):
        # The gateway's field names become the OpenAI parameter the client sent.
        param = oa.param_for(req, exc.field)
        shown = exc.field if exc.field.startswith(param) else param  # keep "messages.role"
        message = shown + str(exc)[len(exc.field) :]
        return 400, oa.error_body(message, "invalid_request_error", param)
    if isinstance(exc, StatusError | NoWorkerError | AuthError):  # AuthError: a class denied
        code = code_for(exc)
        status, kind = oa.http_for_status(code)
        return status, oa.error_body(str(exc), kind, None, code.name.lower())
    raise exc


def asked_priority(headers: Mapping[str, str]) -> Priority | None:
    """The class the `x-pdserve-priority` header asks for (None: the key's default);
    SchemaError naming the header for a name no class has."""
    value = headers.get(PRIORITY_HEADER)
    if value is None:
        return None
    try:
        return Priority.parse(value, PRIORITY_HEADER)
    except ValueError as exc:
        message = str(exc).removeprefix(PRIORITY_HEADER + " ")
        raise oa.SchemaError(PRIORITY_HEADER, message) from None


def _bound_buffers(request: web.Request, messages: int) -> None:
    """Keep an SSE stream's socket and transport buffers to about `messages` events."""
    transport = request.transport
    if transport is None:
        return
    limit = max(MIN_SOCKET_BUFFER, messages * EVENT_BYTES)
    transport.set_write_buffer_limits(high=limit)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)


class SseDisconnect:
    """Ends an SSE answer whose client stopped reading (`StreamBuffer`'s `disconnect`).

    It runs in the request's pump task while the handler's task waits for the socket to
    drain. The error event and `[DONE]` are queued behind what the client has yet to read
    (never waiting for room), the connection is closed once they are out, and dropped
    after `CLOSE_GRACE_S` if they are not; either way aiohttp then cancels the handler.
    """

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None  # set once the SSE answer started
        self.oa_request: oa.OpenAIRequest | None = None

    async def __call__(self, error: StatusError) -> None:
        transport = self.request.transport
        if transport is None:
            return
        if self.response is not None and self.oa_request is not None:
            body = _failure(error, self.oa_request)[1]
            last = f"data: {_dumps(body)}\n\ndata: [DONE]\n\n".encode()
            with contextlib.suppress(Exception):  # best effort: the client may never read it
                await asyncio.wait_for(self.response.write(last), CLOSE_GRACE_S)
        transport.close()
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown routes, wrong methods, oversized bodies and bugs, in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        message = f"{request.method} {request.path}: {exc.reason}"
        code = exc.reason.lower().replace(" ", "_")
        return _json(exc.status, oa.error_body(message, kind, None, code))
    except ConnectionResetError:
        raise  # the client is gone; nobody to answer
    except Exception as exc:
        log.exception("HTTP %s %s failed", request.method, request.path)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return _json(500, oa.error_body(message, "server_error"))


def _auth_middleware(service: GatewayService) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every route needs a valid API key when the gateway has a keys file: the same
    `Access` as gRPC, from `Authorization: Bearer <key>` (what the openai client sends)."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        try:
            request[PRINCIPAL] = service.access.authenticate(request.headers.items())
        except AuthError as exc:
            denied = (403, "permission_error")
            status, kind = denied if exc.denied else (401, "authentication_error")
            return _json(status, oa.error_body(str(exc), kind, None, "invalid_api_key"))
        return await handler(request)

    return authenticate


def _refusal_response(exc: Refusal) -> web.Response:
    """429 (quota, stream cap) or 503 (overload), always with a `Retry-After`."""
    status, kind = oa.http_for_status(code_for(exc))
    code = "rate_limit_exceeded" if status == 429 else f"overloaded_{exc.reason.value}"
    response = _json(status, oa.error_body(str(exc), kind, None, code))
    response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    response.headers[f"x-pdserve-{REFUSAL_REASON_KEY}"] = exc.reason.value
    return response


class HttpApi:
    def __init__(self, service: GatewayService, drain_s: float) -> None:
        self.service = service
        self.started = int(time.time())
        app = web.Application(
            middlewares=[_openai_errors, _auth_middleware(service)],
            client_max_size=MAX_BODY_BYTES,
        )
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        ServingRoutes(service).add_to(app)
        # handler_cancellation: a disconnect cancels the handler even while it waits for
        # prefill, so the request is cancelled on the workers, not just at the next write.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=drain_s, access_log=None
        )

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> str:
        """Bind and serve; returns "host:port" with the port actually bound."""
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, host, port, ssl_context=ssl_context, reuse_address=False,
            reuse_port=False,
        )  # fmt: skip
        await site.start()
        bound = self._runner.addresses[0]
        return f"{host}:{bound[1]}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    # -- routes ------------------------------------------------------------------------
    def _card(self, card: ModelCard) -> oa.Json:
        out: dict[str, object] = {
            "id": card.id,
            "object": "model",
            "created": self.started,
            "owned_by": "pdserve",
            "max_model_len": card.max_model_len,
        }
        if card.parent:  # a LoRA adapter: the model it adapts (as vLLM lists them)
            out["parent"] = card.parent
        return out

    async def _models(self, request: web.Request) -> web.StreamResponse:
        cards = [self._card(c) for c in self.service.models.cards()]
        return _json(200, {"object": "list", "data": cards})

    async def _model(self, request: web.Request) -> web.StreamResponse:
        try:
            card = self.service.models.card(request.match_info["model"])
        except UnknownModelError as exc:
            body = oa.error_body(str(exc), "not_found_error", "model", "model_not_found")
            return _json(404, body)
        return _json(200, self._card(card))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, oa.parse_completion)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, oa.parse_chat)

    # -- one request -------------------------------------------------------------------
    async def _serve(
        self, request: web.Request, parse: Callable[[object], oa.OpenAIRequest]
    ) -> web.StreamResponse:
        try:
            req = parse(read_json(await request.read()))
            asked = asked_priority(request.headers)
        except oa.SchemaError as exc:
            if exc.limit:  # refused as the gRPC door refuses the same value
                self.service.telemetry.count_error(grpc.StatusCode.INVALID_ARGUMENT)
            return _json(400, oa.error_body(str(exc), "invalid_request_error", exc.param))
        request_id = uuid.uuid4().hex
        try:
            model = self.service.models.resolve(req.model)
        except UnknownModelError as exc:
            return _json(*_failure(exc, req))
        answer = self._answer(req, request_id, model.served)
        client = oa.to_client_request(req, model, request_id, asked)
        disconnect = SseDisconnect(request)
        # Closing the generator (on return, error or cancellation) cancels the request on
        # both workers and gives back the stream slot.
        async with contextlib.aclosing(
            self.service.stream(client, request[PRINCIPAL], disconnect)
        ) as messages:
            try:
                first = await anext(messages)
                if not req.stream:
                    return _json(200, await self._whole(answer, first, messages))
            except (
                InvalidRequestError, UnknownModelError, StatusError, NoWorkerError, AuthError
            ) as exc:  # fmt: skip
                return _json(*_failure(exc, req))
            except Refusal as exc:
                return _refusal_response(exc)
            return await self._sse(request, answer, first, messages, disconnect)

    @staticmethod
    def _answer(req: oa.OpenAIRequest, request_id: str, served: ServedModel) -> Answer:
        tokenizer = served.tokenizer
        prompt = req.prompt
        if req.sampling.echo and req.prompt_token_ids:
            prompt = tokenizer.decode(list(req.prompt_token_ids), skip_special_tokens=False)
        # The name asked for: an adapter's answers say the adapter, as OpenAI's echo it.
        return Answer(req, req.model or served.name, request_id, TokenText(tokenizer), prompt)

    async def _whole(
        self, answer: Answer, first: gateway_pb2.GenerateResponse, messages: Messages
    ) -> oa.Json:
        choices = Choices(answer.req.sampling.best_of)
        choices.add(first)
        async for msg in messages:
            choices.add(msg)
        return answer.whole(choices)

    async def _sse(
        self,
        request: web.Request,
        answer: Answer,
        first: gateway_pb2.GenerateResponse,
        messages: Messages,
        disconnect: SseDisconnect,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        _bound_buffers(request, self.service.config.stream_buffer_messages)
        disconnect.response, disconnect.oa_request = response, answer.req
        forks = answer.req.sampling.best_of
        opened: set[int] = set()
        done = 0
        msg = first
        try:
            while True:
                done += msg.finished
                if done == forks:  # the last fork's last message
                    break
                # Deltas held back by the detokenizer or a possible stop string are empty.
                if msg.text or msg.logprobs or msg.finished or msg.index not in opened:
                    await _event(response, answer.chunk(msg, first=msg.index not in opened))
                    opened.add(msg.index)
                    # Take the next message only once this one has left: a client that
                    # stops reading leaves its messages in the request's StreamBuffer.
                    await request.writer.drain()
                msg = await anext(messages)
            # The request is over: give back what it holds now, not once a slow client
            # has taken the last events.
            await messages.aclose()
            tail = [answer.chunk(msg, first=msg.index not in opened)]
            if answer.req.include_usage:
                tail.append(answer.usage_chunk(msg.usage))
        except (StatusError, NoWorkerError) as exc:
            tail = [_failure(exc, answer.req)[1]]
        except ConnectionResetError:
            raise
        except Exception as exc:  # the 200 is sent: say so in the stream, not in a new response
            log.exception("SSE stream %s failed", answer.id)
            tail = [oa.error_body(f"internal error: {exc}", "server_error")]
        await self._end_sse(request, response, tail)
        return response

    async def _end_sse(
        self, request: web.Request, response: web.StreamResponse, tail: list[oa.Json]
    ) -> None:
        """The last events, `[DONE]` and the end of the body; a client that does not take
        them within the slow-client timeout loses the connection instead."""
        last = "".join(f"data: {_dumps(body)}\n\n" for body in tail) + "data: [DONE]\n\n"
        try:
            async with asyncio.timeout(self.service.config.slow_client_timeout_s):
                await response.write(last.encode())
                await response.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()


async def _event(response: web.StreamResponse, body: oa.Json) -> None:
    await response.write(f"data: {_dumps(body)}\n\n".encode())
