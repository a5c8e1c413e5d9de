"""The Router gRPC service: Route and Release over the Redis router, for any client.

The gateway embeds the same library (`RedisPlacement`), so it needs no extra hop; this
service is for clients in other languages and for scaling routing separately. Every
replica shares one Redis, and the bound holds across all of them because each decision
is one atomic Lua script there.

Lifecycle: `serve_router(host, port, config)` connects (or starts an embedded Redis
when no URL is given), serves until SIGTERM/SIGINT, then closes.
"""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry.trace import SpanKind

from pdserve.v1 import router_pb2, router_pb2_grpc
from services.common.grpc_server import announce_ready, build_server, wait_for_shutdown_signal
from services.common.request_codec import adapter_of
from services.common.status import status_for
from services.common.telemetry import Telemetry
from services.common.telemetry_config import TelemetryConfig
from services.common.tls import TlsConfig
from services.common.tracing import Tracing
from services.router.metrics import RouterCollector
from services.router.placement import NoWorkerError, RouteQuery, WorkerRef
from services.router.redis_placement import RedisPlacement
from services.router.router_config import RouterConfig


def _ref(ref: WorkerRef | None) -> router_pb2.WorkerRef | None:
    if ref is None:
        return None
    return router_pb2.WorkerRef(worker_id=ref.worker_id, address=ref.address, role=ref.role)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, placement: RedisPlacement, tracing: Tracing | None = None) -> None:
        self.placement = placement
        self.tracing = tracing or Tracing.disabled("pdserve-router")

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        span = None
        if self.tracing.enabled:  # a router.route span under the caller's trace
            span = self.tracing.start(
                "router.route",
                self.tracing.extract(context.invocation_metadata()),
                {"pdserve.request_id": request.request_id, "pdserve.tenant": request.tenant},
                kind=SpanKind.SERVER,
            )
        try:
            query = RouteQuery(
                request.request_id, tuple(request.prompt_token_ids), request.tenant,
                tuple(request.exclude_workers), adapter=adapter_of(request.adapter),
            )  # fmt: skip
            decision = await self.placement.route(query)
        except NoWorkerError as exc:
            code, message = status_for(exc)
            if span is not None:
                Tracing.fail(span, code.name, message)
                span.end()
            await context.abort(code, message)
            raise
        if span is not None:
            if decision.prefill is not None:
                span.set_attribute("pdserve.prefill_worker", decision.prefill.worker_id)
            span.set_attribute("pdserve.decode_worker", decision.decode.worker_id)
            span.end()
        return router_pb2.RouteResponse(
            prefill=_ref(decision.prefill),
            decode=_ref(decision.decode),
            load_lease_ids=list(decision.load_lease_ids),
        )

    async def Release(
        self, request: router_pb2.ReleaseLoadRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReleaseLoadResponse:
        ids = list(request.load_lease_ids)
        await asyncio.to_thread(self.placement.router.release, ids)
        return router_pb2.ReleaseLoadResponse(released=len(ids))


async def serve_router(
    host: str,
    port: int,
    config: RouterConfig,
    telemetry_cfg: TelemetryConfig | None = None,
    tls: TlsConfig | None = None,
) -> None:
    telemetry = Telemetry.start(telemetry_cfg or TelemetryConfig(), "pdserve-router")
    placement = RedisPlacement.from_config(config)
    router = placement.router
    telemetry.registry.register(RouterCollector(lambda: router.stats))
    names = [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name]
    built = build_server(host, port, names, tls=tls)
    service = RouterService(placement, telemetry.tracing)
    router_pb2_grpc.add_RouterServicer_to_server(service, built.server)
    await built.server.start()
    await built.mark_serving()
    announce_ready(ready=f"{host}:{built.port}", role="router", redis_url=placement.redis_url,
                   **telemetry.ready_fields())  # fmt: skip
    await wait_for_shutdown_signal()
    await built.mark_not_serving()
    await built.server.stop(grace=2.0)
    placement.close()
    telemetry.close()
