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

from pdserve.v1 import router_pb2, router_pb2_grpc
from services.common.grpc_server import announce_ready, build_server, wait_for_shutdown_signal
from services.router.placement import NoWorkerError, WorkerRef
from services.router.redis_placement import RedisPlacement
from services.router.router_config import RouterConfig


def _ref(ref: WorkerRef | None) -> router_pb2.WorkerRef | None:
    if ref is None:
        return None
    return router_pb2.WorkerRef(worker_id=ref.worker_id, address=ref.address, role=ref.role)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, placement: RedisPlacement) -> None:
        self.placement = placement

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        try:
            decision = await self.placement.route(
                request.request_id,
                list(request.prompt_token_ids),
                request.tenant,
                list(request.exclude_workers),
            )
        except NoWorkerError as exc:
            await context.abort(exc.code, str(exc))
            raise
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


async def serve_router(host: str, port: int, config: RouterConfig) -> None:
    placement = RedisPlacement.from_config(config)
    built = build_server(host, port, [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name])
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(placement), built.server)
    await built.server.start()
    await built.mark_serving()
    announce_ready(ready=f"{host}:{built.port}", role="router", redis_url=placement.redis_url)
    await wait_for_shutdown_signal()
    await built.mark_not_serving()
    await built.server.stop(grace=2.0)
    placement.close()
