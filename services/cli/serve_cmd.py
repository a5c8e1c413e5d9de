"""`pdserve worker` and `pdserve gateway`: run one service process in the foreground."""

from __future__ import annotations

import argparse
import asyncio

from engine.config import EngineConfig
from kvtransfer.config import TransferConfig
from services.common.config import add_config_args, config_from_args
from services.common.model_config import ModelConfig
from services.common.telemetry_config import TelemetryConfig
from services.common.tls import TlsConfig
from services.gateway.config import GatewayConfig
from services.router.router_config import RouterConfig
from services.worker.config import WorkerConfig


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = sub.add_parser("worker", help="run a prefill, decode or mixed worker")
    add_config_args(worker, WorkerConfig)
    add_config_args(worker, EngineConfig)
    add_config_args(worker, TransferConfig)
    add_config_args(worker, TelemetryConfig)
    add_config_args(worker, TlsConfig)
    worker.set_defaults(handler=_worker)
    gateway = sub.add_parser("gateway", help="run the gateway")
    add_config_args(gateway, GatewayConfig)
    add_config_args(gateway, ModelConfig)
    add_config_args(gateway, RouterConfig)
    add_config_args(gateway, TelemetryConfig)
    add_config_args(gateway, TlsConfig)
    gateway.set_defaults(handler=_gateway)
    router = sub.add_parser("router", help="run a Router service replica (Route/Release)")
    router.add_argument("--router-host", default="127.0.0.1", help="address to bind")
    router.add_argument("--router-port", type=int, default=0, help="port (0 = any free port)")
    add_config_args(router, RouterConfig)
    add_config_args(router, TelemetryConfig)
    add_config_args(router, TlsConfig)
    router.set_defaults(handler=_router)


def _worker(args: argparse.Namespace) -> int:
    from services.worker.server import serve_worker

    worker_cfg = config_from_args(WorkerConfig, args)
    if worker_cfg.cpu_core_ids:
        from services.cluster.local_cluster import pin_to_cores

        pin_to_cores(worker_cfg.cpu_core_ids)  # before the engine starts its threads
    asyncio.run(
        serve_worker(
            worker_cfg,
            config_from_args(EngineConfig, args),
            config_from_args(TransferConfig, args),
            config_from_args(TelemetryConfig, args),
            config_from_args(TlsConfig, args),
        )
    )
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from services.gateway.server import serve_gateway

    asyncio.run(
        serve_gateway(
            config_from_args(GatewayConfig, args),
            config_from_args(ModelConfig, args),
            config_from_args(RouterConfig, args),
            config_from_args(TelemetryConfig, args),
            config_from_args(TlsConfig, args),
        )
    )
    return 0


def _router(args: argparse.Namespace) -> int:
    from services.router.service import serve_router

    asyncio.run(
        serve_router(
            args.router_host,
            args.router_port,
            config_from_args(RouterConfig, args),
            config_from_args(TelemetryConfig, args),
            config_from_args(TlsConfig, args),
        )
    )
    return 0
