"""`pdserve up`, `pdserve generate` and `pdserve status`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
from collections.abc import Callable

from services.cli import ray_cmd
from services.cli.completion import stream_completion
from services.cli.rollout_cmd import describe_rollout
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.config import add_config_args, config_from_args
from services.common.telemetry_config import TelemetryConfig
from services.common.tls import TlsConfig
from services.gateway.client import ClientConfig, GatewayClient

DEFAULT_GATEWAY = "127.0.0.1:8470"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser("up", help="start a local cluster (workers + gateway) and wait")
    add_config_args(up, ClusterConfig)
    add_config_args(up, TelemetryConfig)
    add_config_args(up, TlsConfig)
    add_config_args(up, ClientConfig)
    up.add_argument("--generate", metavar="PROMPT", help="stream one completion, then stop")
    up.add_argument("--max-tokens", type=int, default=64, help="tokens for --generate")
    ray_cmd.add_up_args(up)
    up.set_defaults(handler=_up)
    gen = sub.add_parser("generate", help="stream a completion through the gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default=DEFAULT_GATEWAY, help="gateway address")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--trace", action="store_true", help="print the phase timeline at the end")
    add_config_args(gen, ClientConfig)
    add_config_args(gen, TlsConfig)
    gen.set_defaults(handler=_generate)
    status = sub.add_parser("status", help="show workers, KV blocks and load")
    status.add_argument("--gateway", default=DEFAULT_GATEWAY, help="gateway address")
    add_config_args(status, ClientConfig)
    add_config_args(status, TlsConfig)
    status.set_defaults(handler=_status)


def _client(address: str, args: argparse.Namespace) -> Callable[[], GatewayClient]:
    """Builds a client with the command's --api-key and --tls-* settings. A factory: a
    grpc.aio channel belongs to the event loop it is created in, so the client must be
    made inside `asyncio.run`, not before it."""
    client_cfg = config_from_args(ClientConfig, args)
    tls = config_from_args(TlsConfig, args)
    return functools.partial(GatewayClient, address, api_key=client_cfg.api_key, tls=tls)


def _up(args: argparse.Namespace) -> int:
    if args.ray is not None:
        return ray_cmd.up_ray(args)
    cluster = LocalCluster(
        config_from_args(ClusterConfig, args),
        config_from_args(TelemetryConfig, args),
        config_from_args(TlsConfig, args),
    )
    stop = [False]

    def on_signal(signum: int, frame: object) -> None:
        stop[0] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        address = cluster.start()
        http = f", OpenAI API http://{cluster.http_address}/v1" if cluster.http_address else ""
        # The Redis URL is what `pdserve usage` reads the usage ledger from.
        store = f", Redis {cluster.redis.url}" if cluster.redis is not None else ""
        print(f"pdserve cluster ready: gateway {address}{http}{store}", file=sys.stderr)
        if args.generate:
            return asyncio.run(
                stream_completion(
                    _client(address, args), args.generate, raw=False, max_tokens=args.max_tokens
                )
            )
        signal.sigwait({signal.SIGINT, signal.SIGTERM}) if not stop[0] else None
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        print("pdserve: stopping the cluster", file=sys.stderr)
        cluster.stop()


def _generate(args: argparse.Namespace) -> int:
    return asyncio.run(
        stream_completion(_client(args.gateway, args), args.prompt, raw=args.raw,
                          trace=args.trace,
                          max_tokens=args.max_tokens, temperature=args.temperature,
                          seed=args.seed)
    )  # fmt: skip


def _status(args: argparse.Namespace) -> int:
    async def fetch() -> int:
        async with _client(args.gateway, args)() as client:
            status = await client.cluster_status()
        print(f"streams: {status.active_streams}/{status.max_streams}")
        print(f"{'worker':<14}{'role':<10}{'address':<22}{'blocks used/total':>18}{'held':>6}"
              f"{'run':>5}{'wait':>5}{'leases':>7}{'hit%':>6}{'tier':>12}")  # fmt: skip
        for w in status.workers:
            hit = (
                100 * w.prefix_hit_tokens / w.prefix_query_tokens if w.prefix_query_tokens else 0.0
            )
            used = f"{w.used_blocks}/{w.total_blocks}"
            cap = w.offload_capacity_blocks
            tier = f"{w.offload_blocks}/{cap}" if cap else "-"  # offload tier cached/total
            print(
                f"{w.worker_id:<14}{w.role:<10}{w.address:<22}{used:>18}{w.held_blocks:>6}"
                f"{w.running:>5}{w.waiting:>5}{w.active_leases:>7}{hit:>6.1f}{tier:>12}"
            )
        for w in status.workers:
            if w.lora_adapters:
                print(f"{w.worker_id}: LoRA adapters {', '.join(w.lora_adapters)}")
        for rollout in status.rollouts:
            print(describe_rollout(rollout))
        return 0

    return asyncio.run(fetch())
