"""`pdserve worker` and `pdserve gateway`: run one service process in the foreground."""

from __future__ import annotations

import argparse
import asyncio

from engine.config import EngineConfig
from kvtransfer.config import TransferConfig
from services.cli.model_cmd import ModelConfig
from services.common.config import add_config_args, config_from_args
from services.common.worker_config import WorkerConfig
from services.gateway.config import GatewayConfig


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = sub.add_parser("worker", help="run a prefill, decode or mixed worker")
    add_config_args(worker, WorkerConfig)
    add_config_args(worker, EngineConfig)
    add_config_args(worker, TransferConfig)
    worker.set_defaults(handler=_worker)
    gateway = sub.add_parser("gateway", help="run the gateway")
    add_config_args(gateway, GatewayConfig)
    add_config_args(gateway, ModelConfig)
    gateway.set_defaults(handler=_gateway)


def _worker(args: argparse.Namespace) -> int:
    from services.common.worker_server import serve_worker

    asyncio.run(
        serve_worker(
            config_from_args(WorkerConfig, args),
            config_from_args(EngineConfig, args),
            config_from_args(TransferConfig, args),
        )
    )
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from services.gateway.server import serve_gateway

    asyncio.run(
        serve_gateway(config_from_args(GatewayConfig, args), config_from_args(ModelConfig, args))
    )
    return 0
