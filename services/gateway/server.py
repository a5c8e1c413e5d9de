"""The gateway process.

Lifecycle: `serve_gateway(config, model_cfg)` loads the tokenizer and model shape
(converting the default model on first use) and builds the catalog of the models it
serves, each on its placement (static worker lists, or the Redis router on the workers'
registry) and admission, then starts the gRPC server with
health and reflection and the OpenAI-compatible HTTP API beside it on the same event
loop (unless --http-port is -1), prints a JSON ready line with both addresses, and
serves until SIGTERM/SIGINT; then it reports NOT_SERVING and lets open streams on both
finish for a few seconds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

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
from services.gateway.access.gate import Access
from services.gateway.access.usage_ledger import LedgerCollector, LedgerConfig, UsageLedger
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission import Admission
from services.gateway.flow.admission_metrics import AdmissionMetrics
from services.gateway.flow.fair_share import FairShare
from services.gateway.models.adapter_catalog import AdapterCatalog
from services.gateway.models.backend import Backend, SharedParts
from services.gateway.models.catalog import build_catalog
from services.gateway.models.rollout_admin import RolloutAdmin
from services.gateway.models.rollout_follower import RollbackPolicy, RolloutFollower
from services.gateway.models.served_model import ServedModelSpec
from services.gateway.openai.http_api import HttpApi
from services.gateway.service import GatewayService
from services.gateway.stream.record_book import HeldCollector
from services.gateway.stream.telemetry import GatewayTelemetry
from services.gateway.stream.worker_stubs import WorkerStubs
from services.gateway.wire import add_servicer
from services.router.identity_check import GATEWAY_PARTS
from services.router.keyspace import Keyspace, pool_namespace
from services.router.placement import Placement, StaticPlacement
from services.router.redis_client import connect
from services.router.redis_placement import RedisPlacement
from services.router.rollout_store import RolloutStore
from services.router.router_config import RouterConfig
from services.router.worker_signal import SignalBoard

log = logging.getLogger(__name__)

DRAIN_S = 5.0


def build_placement(config: GatewayConfig, router: RouterConfig) -> Placement:
    if config.placement == "static":
        return StaticPlacement.from_addresses(config.prefill_list, config.decode_list)
    if not router.redis_url:
        raise ValueError("placement redis needs --redis-url (the Redis the workers register with)")
    return RedisPlacement.from_config(router)


@dataclass(frozen=True)
class ModelSource:
    """One model the gateway serves: its name, directory, spec and pool namespace."""

    name: str
    model_dir: Path
    pool_namespace: str
    named: bool  # served under a name of its own (so it may have versions)

    @functools.cached_property
    def spec(self) -> ModelSpec:
        # The tokenizer side only: a gateway never reads (or hashes) the weights.
        return ModelSpec.from_dir(self.model_dir, hash_weights=False)


def model_sources(
    config: GatewayConfig, model_cfg: ModelConfig, namespace: str
) -> list[ModelSource]:
    """The primary model (`--model`), then each of `--extra-models`, resolved."""
    cache = model_cfg.model_cache_dir.expanduser()
    primary = ModelSource(
        config.served_model_name or model_cfg.model or DEFAULT_MODEL_NAME,
        resolve_model_dir(model_cfg.model, cache, progress=False),
        pool_namespace(namespace, config.served_model_name),
        named=bool(config.served_model_name),
    )
    extras = []
    for name, path in config.extra_model_dirs.items():
        model_dir = resolve_model_dir(path, cache, progress=False)
        extras.append(ModelSource(name, model_dir, pool_namespace(namespace, name), named=True))
    return [primary, *extras]


def build_service(
    config: GatewayConfig,
    model_cfg: ModelConfig,
    router: RouterConfig,
    telemetry: Telemetry | None = None,
    tls: TlsConfig | None = None,
) -> GatewayService:
    sources = model_sources(config, model_cfg, router.namespace)
    # The primary's placement first: it may start the embedded Redis the others share.
    first = build_placement(config, replace(router, namespace=sources[0].pool_namespace))
    client = shared_redis(first, router)
    parts = VersionParts(
        config, router, _redis_url(first, router), client,
        AdmissionMetrics(telemetry.registry if telemetry else None),
        FairShare(client, router.namespace, config.fair_share_half_life_s) if client else None,
    )  # fmt: skip
    placements = [first, *(parts.placement(s.pool_namespace) for s in sources[1:])]
    shared = SharedParts(
        Access.from_config(config, client, router.namespace),
        WorkerStubs(tls or TlsConfig()),
        ledger=_ledger(config, client, router.namespace),
    )
    specs = []
    for source, placement in zip(sources, placements, strict=True):
        spec = source.spec
        parts.expect(placement, spec)
        tokenizer, vocab = Tokenizer(source.model_dir), spec.vocab_size
        limit = spec.max_position_embeddings
        admission = parts.admission(source.pool_namespace)
        specs.append(ServedModelSpec(source.name, tokenizer, limit, vocab, placement, admission))
    models = build_catalog(specs, shared)
    tel = (
        GatewayTelemetry.on(telemetry, models.placements, config.tenant_label_limit)
        if telemetry
        else None
    )
    service = GatewayService(config, models, shared, tel)
    if config.lora_dir:
        service.models.primary.adapters = AdapterCatalog(Path(config.lora_dir).expanduser())
    if client is not None and isinstance(first, RedisPlacement):
        follow_rollouts(service, sources, parts, tel)
    if telemetry is not None:
        # pdserve_gateway_held{resource}: what live requests hold (a leak check wants 0s).
        telemetry.registry.register(HeldCollector(service.book))
        if shared.ledger is not None:
            telemetry.registry.register(LedgerCollector(shared.ledger.counts))
    return service


def _ledger(
    config: GatewayConfig, client: redis.Redis | None, namespace: str
) -> UsageLedger | None:
    """The usage ledger on the gateway's Redis (None without one, or turned off)."""
    if client is None or not config.usage_ledger:
        return None
    cfg = LedgerConfig(retention_s=config.usage_retention_s, max_entries=config.usage_max_entries)
    return UsageLedger(client, namespace, cfg)


@dataclass(frozen=True)
class VersionParts:
    """What it takes to serve one version of a model: a router on its pool namespace
    (on the gateway's one Redis), the identity check, and admission on its signals."""

    config: GatewayConfig
    router: RouterConfig
    redis_url: str
    client: redis.Redis | None
    metrics: AdmissionMetrics  # one set for the gateway: a registry takes a name once
    fair: FairShare | None  # the gateway's: a tenant's share is across models

    def placement(self, pool_ns: str) -> Placement:
        cfg = replace(self.router, namespace=pool_ns, redis_url=self.redis_url)
        return build_placement(self.config, cfg)

    @staticmethod
    def expect(placement: Placement, spec: ModelSpec) -> None:
        if isinstance(placement, RedisPlacement) and spec.identity is not None:
            # Refuse to route while its workers' tokenizer, template or config is not ours.
            placement.router.expect_identity(spec.identity, GATEWAY_PARTS, "this gateway")

    def admission(self, pool_ns: str) -> Admission:
        """Admission control on the signals of one version's workers in Redis (off
        without a Redis)."""
        if self.client is None or not self.config.admission_control:
            return Admission(self.config, metrics=self.metrics)
        board = SignalBoard(self.client, Keyspace(pool_ns))
        return Admission(self.config, board, self.fair, self.metrics)


def follow_rollouts(
    service: GatewayService,
    sources: list[ModelSource],
    parts: VersionParts,
    telemetry: GatewayTelemetry | None,
) -> None:
    """Give each named model its rollout follower (and the means to serve a version a
    rollout names), read each rollout once before serving, and start following."""
    assert parts.client is not None
    namespace = parts.router.namespace
    store = RolloutStore(parts.client, namespace)
    # Every gateway follows a promote within two of its refreshes, and their routers
    # see the drained workers within a membership refresh.
    drain_after_s = 2 * parts.config.rollout_refresh_s + parts.router.membership_refresh_s
    service.rollouts = RolloutAdmin(service.models, store, namespace, drain_after_s)
    for source, model in zip(sources, service.models, strict=True):
        if not source.named:
            continue  # the unnamed model has one pool: nothing to roll out

        def make(version: str, source: ModelSource = source) -> Backend:
            pool = pool_namespace(namespace, source.name, version)
            placement = parts.placement(pool)
            parts.expect(placement, source.spec)
            return service.parts.backend(version, placement, parts.admission(pool))

        def rolled_back(reason: str, name: str = model.name) -> None:
            if telemetry is not None:
                telemetry.count_rollback(name)

        model.make_backend = make
        policy = RollbackPolicy.from_config(parts.config)
        model.follower = RolloutFollower(
            store, model.name, policy, model.ensure_version, rolled_back
        )
        try:
            model.follower.tick()
        except Exception as exc:  # Redis away at start: the loop tries again
            log.warning("model %s: rollout state unreadable at start: %s", model.name, exc)
        model.follower.start(parts.config.rollout_refresh_s)


def _redis_url(placement: Placement, router: RouterConfig) -> str:
    """The Redis every model's router shares: the primary's (its embedded one, when
    --redis-url is empty)."""
    return placement.redis_url if isinstance(placement, RedisPlacement) else router.redis_url


def shared_redis(placement: Placement, router: RouterConfig) -> redis.Redis | None:
    """The Redis quotas, worker signals and fair shares live in: the router's (or
    --redis-url's); None without one."""
    if isinstance(placement, RedisPlacement):
        return placement.client
    if router.redis_url:
        return connect(router.redis_url, router.redis_timeout_s)
    return None


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
    backends = service.models.backends()
    for backend in reversed(backends):  # the primary's base version owns an embedded Redis
        close = getattr(backend.placement, "close", None)
        if close is not None:
            close()
    telemetry.close()
