"""The gateway process.

Lifecycle: `serve_gateway(config, model_cfg)` loads the tokenizer and model shape
(converting the default model on first use), builds the placement (static worker
lists, or the Redis router on the workers' registry), starts the gRPC server with
health and reflection and the OpenAI-compatible HTTP API beside it on the same event
loop (unless --http-port is -1), prints a JSON ready line with both addresses, and
serves until SIGTERM/SIGINT; then it reports NOT_SERVING and lets open streams on both
finish for a few seconds.
"""

from __future__ import annotations

import asyncio

import redis

from engine.model_spec import ModelSpec
from engine.model_store import DEFAULT_MODEL_NAME, resolve_model_dir
from engine.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.grpc_server import announce_ready, build_server, wait_for_shutdown_signal
from services.common.model_config import ModelConfig
from services.common.telemetry import Telemetry
from services.common.telemetry_config import TelemetryConfig
from services.common.tls import TlsConfig, server_ssl_context
from services.gateway.access import Access
from services.gateway.admission import Admission
from services.gateway.admission_metrics import AdmissionMetrics
from services.gateway.config import GatewayConfig
from services.gateway.fair_share import FairShare
from services.gateway.http_api import HttpApi
from services.gateway.record_book import HeldCollector
from services.gateway.service import GatewayService
from services.gateway.stream_telemetry import GatewayTelemetry
from services.gateway.wire import add_servicer
from services.gateway.worker_stubs import WorkerStubs
from services.router.keyspace import Keyspace
from services.router.placement import Placement, StaticPlacement
from services.router.redis_client import connect
from services.router.redis_placement import RedisPlacement
from services.router.router_config import RouterConfig
from services.router.worker_signal import SignalBoard

DRAIN_S = 5.0


def build_placement(config: GatewayConfig, router: RouterConfig) -> Placement:
    if config.placement == "static":
        return StaticPlacement.from_addresses(config.prefill_list, config.decode_list)
    if not router.redis_url:
        raise ValueError("placement redis needs --redis-url (the Redis the workers register with)")
    return RedisPlacement.from_config(router)


def build_service(
    config: GatewayConfig,
    model_cfg: ModelConfig,
    router: RouterConfig,
    telemetry: Telemetry | None = None,
    tls: TlsConfig | None = None,
) -> GatewayService:
    cache = model_cfg.model_cache_dir.expanduser()
    model_dir = resolve_model_dir(model_cfg.model, cache, progress=False)
    spec = ModelSpec.from_dir(model_dir)
    placement = build_placement(config, router)
    name = model_cfg.model or DEFAULT_MODEL_NAME
    tel = GatewayTelemetry.on(telemetry, placement) if telemetry else None
    client = shared_redis(placement, router)
    access = Access.from_config(config, client, router.namespace)
    admission = build_admission(config, client, router, telemetry)
    service = GatewayService(
        config, placement, Tokenizer(model_dir), name, spec.max_position_embeddings,
        spec.vocab_size, tel, access, WorkerStubs(tls or TlsConfig()), admission,
    )  # fmt: skip
    if telemetry is not None:
        # pdserve_gateway_held{resource}: what live requests hold (a leak check wants 0s).
        telemetry.registry.register(HeldCollector(service.book))
    return service


def shared_redis(placement: Placement, router: RouterConfig) -> redis.Redis | None:
    """The Redis quotas, worker signals and fair shares live in: the router's (or
    --redis-url's); None without one."""
    if isinstance(placement, RedisPlacement):
        return placement.client
    if router.redis_url:
        return connect(router.redis_url, router.redis_timeout_s)
    return None


def build_admission(
    config: GatewayConfig,
    client: redis.Redis | None,
    router: RouterConfig,
    telemetry: Telemetry | None,
) -> Admission:
    """Admission control on the workers' signals in Redis (off without a Redis)."""
    metrics = AdmissionMetrics(telemetry.registry if telemetry else None)
    if client is None or not config.admission_control:
        return Admission(config, metrics=metrics)
    keys = Keyspace(router.namespace)
    fair = FairShare(client, router.namespace, config.fair_share_half_life_s)
    return Admission(config, SignalBoard(client, keys), fair, metrics)


async def serve_gateway(
    config: GatewayConfig,
    model_cfg: ModelConfig,
    router: RouterConfig,
    telemetry_cfg: TelemetryConfig | None = None,
    tls: TlsConfig | None = None,
) -> None:
    tls = tls or TlsConfig()
    telemetry = Telemetry.start(telemetry_cfg or TelemetryConfig(), "pdserve-gateway")
    service = build_service(config, model_cfg, router, telemetry, tls)
    built = build_server(
        config.gateway_host,
        config.gateway_port,
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
        tls=tls,
    )
    add_servicer(gateway_pb2_grpc.add_GatewayServicer_to_server, service, built.server)
    await built.server.start()
    http = HttpApi(service, DRAIN_S) if config.http_port >= 0 else None
    ssl_context = server_ssl_context(tls)
    http_address = (
        await http.start(config.http_bind_host, config.http_port, ssl_context) if http else ""
    )
    await built.mark_serving()
    address = f"{config.gateway_host}:{built.port}"
    announce_ready(ready=address, role="gateway", http=http_address, **telemetry.ready_fields())
    await wait_for_shutdown_signal()
    await built.mark_not_serving()
    await asyncio.gather(built.server.stop(grace=DRAIN_S), *([http.stop()] if http else []))
    await service.close()
    close = getattr(service.placement, "close", None)
    if close is not None:
        close()
    telemetry.close()
