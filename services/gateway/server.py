"""The gateway process.

Lifecycle: `serve_gateway(config, model_cfg)` loads the tokenizer and model shape
(converting the default model on first use), builds the placement (static worker
lists, or the Redis router on the workers' registry), starts the gRPC server with
health and reflection, prints a JSON ready line, and serves until SIGTERM/SIGINT;
then it reports NOT_SERVING and lets open streams finish for a few seconds.
"""

from __future__ import annotations

from engine.model_spec import ModelSpec
from engine.model_store import DEFAULT_MODEL_NAME, resolve_model_dir
from engine.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.cli.model_cmd import ModelConfig
from services.common.grpc_server import announce_ready, build_server, wait_for_shutdown_signal
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.router.placement import Placement, StaticPlacement
from services.router.redis_placement import RedisPlacement
from services.router.router_config import RouterConfig

DRAIN_S = 5.0


def build_placement(config: GatewayConfig, router: RouterConfig) -> Placement:
    if config.placement == "static":
        return StaticPlacement.from_addresses(config.prefill_list, config.decode_list)
    if not router.redis_url:
        raise ValueError("placement redis needs --redis-url (the Redis the workers register with)")
    return RedisPlacement.from_config(router)


def build_service(
    config: GatewayConfig, model_cfg: ModelConfig, router: RouterConfig
) -> GatewayService:
    cache = model_cfg.model_cache_dir.expanduser()
    model_dir = resolve_model_dir(model_cfg.model, cache, progress=False)
    spec = ModelSpec.from_dir(model_dir)
    placement = build_placement(config, router)
    name = model_cfg.model or DEFAULT_MODEL_NAME
    return GatewayService(
        config, placement, Tokenizer(model_dir), name, spec.max_position_embeddings, spec.vocab_size
    )


async def serve_gateway(
    config: GatewayConfig, model_cfg: ModelConfig, router: RouterConfig
) -> None:
    service = build_service(config, model_cfg, router)
    built = build_server(
        config.gateway_host,
        config.gateway_port,
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name],
    )
    gateway_pb2_grpc.add_GatewayServicer_to_server(service, built.server)
    await built.server.start()
    await built.mark_serving()
    address = f"{config.gateway_host}:{built.port}"
    announce_ready(ready=address, role="gateway")
    await wait_for_shutdown_signal()
    await built.mark_not_serving()
    await built.server.stop(grace=DRAIN_S)
    await service.close()
    close = getattr(service.placement, "close", None)
    if close is not None:
        close()
