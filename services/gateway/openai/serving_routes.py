"""The HTTP routes serving tools expect beside the OpenAI API: health, version, metrics,
and vLLM's tokenize / detokenize.

Lifecycle: `HttpApi` builds one `ServingRoutes(service)` and adds its routes to the app.
`/health`, `/version` and `/metrics` need no API key (load balancers, load testers and
Prometheus call them bare; the HTTP API binds loopback or an operator's interface);
`/tokenize` and `/detokenize` go through the same auth as `/v1`.

`/health` answers 200 only when a request could be placed now: the router knows a live
worker of each role the gateway needs (a prefill and a decode worker, or a mixed one).
It reads the router's cached view of the registry, no worker call.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.tokenizer import ChatMessage, Tokenizer
from services.common.status import UnknownModelError
from services.gateway.models.served_model import ServedModel
from services.gateway.openai.json_body import read_json
from services.gateway.openai.sampling import SchemaError, get_bool
from services.gateway.openai.schema import error_body
from services.gateway.service import GatewayService

#: Paths answered without an API key.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


def _json(status: int, body: object) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda b: json.dumps(b, ensure_ascii=False))


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return _json(status, error_body(message, kind, param))


def missing_roles(roles: set[str]) -> list[str]:
    """The roles a request still needs, given the roles of the live workers."""
    if "mixed" in roles:
        return []
    return [r for r in ("prefill", "decode") if r not in roles]


def package_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ServingRoutes:
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        metrics = service.telemetry.metrics
        self.registry = metrics.registry if metrics is not None else CollectorRegistry()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def health(self, request: web.Request) -> web.StreamResponse:
        """200 while every served model has the workers to place a request on."""
        for model in self.service.models:
            missing = missing_roles({w.role for w in model.stable().placement.workers()})
            if missing:
                whose = f" for model {model.name!r}" if len(self.service.models) > 1 else ""
                message = f"no live {' or '.join(missing)} worker{whose}: requests cannot be placed"
                return _error(503, message, "service_unavailable_error")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.StreamResponse:
        return _json(200, {"version": package_version()})

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            obj, model = await self._body(request)
            ids = self._tokens(obj, model.tokenizer)
        except SchemaError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        limit = model.max_model_len
        return _json(200, {"count": len(ids), "max_model_len": limit, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            obj, model = await self._body(request)
            ids = obj.get("tokens")
            vocab = model.vocab_size
            ok = isinstance(ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
            )
            if not ok:
                raise SchemaError("tokens", f"must be a list of token ids in [0, {vocab})")
        except SchemaError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        assert isinstance(ids, list)
        return _json(200, {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)})

    async def _body(self, request: web.Request) -> tuple[Mapping[str, object], ServedModel]:
        """The JSON body and the model it names (the primary when it names none)."""
        body = read_json(await request.read())
        if not isinstance(body, dict):
            raise SchemaError(None, "the request body must be a JSON object")
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise SchemaError("model", "must be a string")
        try:
            return body, self.service.models.get(name or "")
        except UnknownModelError:
            raise SchemaError("model", f"{name!r} is not served here") from None

    @staticmethod
    def _tokens(obj: Mapping[str, object], tokenizer: Tokenizer) -> list[int]:
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if not isinstance(messages, list) or not messages:
            raise SchemaError("prompt", "send a prompt string or a non-empty messages list")
        chat = []
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                raise SchemaError(f"messages[{i}]", "must be {role, content} with strings")
            chat.append(ChatMessage(m["role"], m["content"]))
        generation = obj.get("add_generation_prompt")
        add = True if generation is None else get_bool(obj, "add_generation_prompt")
        try:
            text = tokenizer.render_chat(chat, add_generation_prompt=add)
        except ValueError as exc:
            raise SchemaError("messages", str(exc)) from None
        return tokenizer.encode(text)
