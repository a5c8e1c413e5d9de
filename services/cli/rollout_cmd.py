"""`pdserve rollout start|promote|abort|status MODEL`: a served model's canary rollout,
through the gateway's Rollout RPC (an admin key's call: --api-key)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys

import grpc

from pdserve.v1 import gateway_pb2
from services.common.config import add_config_args, config_from_args
from services.common.tls import TlsConfig
from services.gateway.client import ClientConfig, GatewayClient

DEFAULT_GATEWAY = "127.0.0.1:8470"
ACTIONS = {
    "status": gateway_pb2.ROLLOUT_ACTION_STATUS,
    "start": gateway_pb2.ROLLOUT_ACTION_START,
    "promote": gateway_pb2.ROLLOUT_ACTION_PROMOTE,
    "abort": gateway_pb2.ROLLOUT_ACTION_ABORT,
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rollout = sub.add_parser("rollout", help="start, promote, abort or show a model's rollout")
    rollout.add_argument("action", choices=list(ACTIONS))
    rollout.add_argument("model", help="the served model's name")
    rollout.add_argument("version", nargs="?", default="", help="start: the canary version")
    rollout.add_argument(
        "--weight", type=float, default=0.1, help="start: the canary's share of requests"
    )
    rollout.add_argument(
        "--sticky", action="store_true", help="start: each tenant's requests all go one way"
    )
    rollout.add_argument("--gateway", default=DEFAULT_GATEWAY, help="gateway address")
    add_config_args(rollout, ClientConfig)
    add_config_args(rollout, TlsConfig)
    rollout.set_defaults(handler=_rollout)


def _rollout(args: argparse.Namespace) -> int:
    if args.action == "start" and not args.version:
        print("pdserve rollout start: name the canary version", file=sys.stderr)
        return 2
    request = gateway_pb2.RolloutRequest(
        model=args.model, action=ACTIONS[args.action], version=args.version,
        weight=args.weight, sticky=args.sticky,
    )  # fmt: skip
    client_cfg = config_from_args(ClientConfig, args)
    tls = config_from_args(TlsConfig, args)
    make = functools.partial(GatewayClient, args.gateway, api_key=client_cfg.api_key, tls=tls)

    async def call() -> gateway_pb2.RolloutStatus:
        async with make() as client:
            return await client.rollout(request)

    try:
        print(describe_rollout(asyncio.run(call())))
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve rollout {args.action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def describe_rollout(r: gateway_pb2.RolloutStatus) -> str:
    """One model's rollout in a few lines (also `pdserve status`)."""
    head = f"rollout {r.model}: {r.phase}; stable {r.stable or '-'!s}"
    if r.canary:
        head += f", canary {r.canary} at {r.weight:.0%}" + (" (sticky)" if r.sticky else "")
    lines = [head]
    if r.reason:
        lines.append(f"  reason: {r.reason}")
    for name, w in (("stable", r.stable_window), ("canary", r.canary_window)):
        if w.requests:
            lines.append(
                f"  {name}: {w.requests} requests, {w.errors} errors, TTFT p90 "
                f"{w.ttft_p90_s:.3f}s, ITL p90 {w.itl_p90_s:.3f}s"
            )
    return "\n".join(lines)
