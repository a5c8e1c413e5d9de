"""`pdserve up --ray [ADDRESS]` and `pdserve scale POOL N`: a pdserve cluster on Ray.

`up --ray` connects to the Ray cluster at ADDRESS (none: a local one on 127.0.0.1),
starts the router, gateway and both worker pools as named actors (services/ray), prints
the gateway address and serves until Ctrl-C or SIGTERM, then drains and stops them.
`scale` resizes a pool of that cluster from any shell on a machine of the Ray cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
from dataclasses import dataclass, field

from services.common.config import add_config_args, config_from_args
from services.common.role import Role


@dataclass(frozen=True)
class RayTarget:
    ray_address: str = field(
        default="auto", metadata={"help": "Ray cluster address (auto: the one on this machine)"}
    )
    ray_namespace: str = field(
        default="pdserve", metadata={"help": "Ray namespace the cluster was started in"}
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    scale = sub.add_parser("scale", help="resize a worker pool of a `pdserve up --ray` cluster")
    scale.add_argument("pool", choices=[r.value for r in Role], help="the pool")
    scale.add_argument("replicas", type=int, help="workers the pool should have")
    add_config_args(scale, RayTarget)
    scale.set_defaults(handler=_scale)


def add_up_args(up: argparse.ArgumentParser) -> None:
    """`pdserve up`'s Ray flags (the RayConfig group only applies with --ray)."""
    from services.ray.config import RayConfig

    up.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="run the cluster as Ray actors on the Ray cluster at ADDRESS "
        "(no ADDRESS: start a local Ray)",
    )  # fmt: skip
    add_config_args(up, RayConfig)


def _scale(args: argparse.Namespace) -> int:
    from services.ray.launcher import connect, scale_pool

    target = config_from_args(RayTarget, args)
    try:
        connect(target.ray_address, target.ray_namespace)
    except ConnectionError as exc:
        print(f"pdserve: error: ray_address {target.ray_address!r}: {exc}", file=sys.stderr)
        return 2
    ids = scale_pool(target.ray_namespace, args.pool, args.replicas)
    print(f"{args.pool}: {len(ids)} worker(s): {', '.join(ids)}")
    return 0


def up_ray(args: argparse.Namespace) -> int:
    """The `--ray` branch of `pdserve up`."""
    from services.cli.completion import stream_completion
    from services.cluster.config import ClusterConfig
    from services.common.telemetry_config import TelemetryConfig
    from services.gateway.client import GatewayClient
    from services.ray.config import RayConfig
    from services.ray.launcher import RayCluster, connect, local_cpus

    cluster_cfg = config_from_args(ClusterConfig, args)
    ray_cfg = config_from_args(RayConfig, args)
    connect(args.ray, ray_cfg.ray_namespace, num_cpus=local_cpus(cluster_cfg, ray_cfg))
    cluster = RayCluster(cluster_cfg, ray_cfg, config_from_args(TelemetryConfig, args))

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        address = cluster.start()
        http = cluster.status()["http"]
        api = f", OpenAI API http://{http}/v1" if http else ""
        print(f"pdserve cluster ready on Ray: gateway {address}{api}", file=sys.stderr)
        if args.generate:
            return asyncio.run(
                stream_completion(
                    functools.partial(GatewayClient, address),
                    args.generate,
                    raw=False,
                    max_tokens=args.max_tokens,
                )
            )
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        print("pdserve: stopping the Ray cluster", file=sys.stderr)
        cluster.stop()
