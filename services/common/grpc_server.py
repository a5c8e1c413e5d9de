"""Building a pdserve gRPC server: loopback bind, health checking and reflection.

Lifecycle: `build_server(host, port)` returns an un-started `grpc.aio.Server` with the
standard health service (reporting SERVING once the caller calls `mark_serving`) and
reflection for the given service names; the caller adds its servicers, starts it, and
on shutdown calls `mark_not_serving` then `server.stop(grace)`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# CHANNEL_OPTIONS is re-exported: the services' channels use kvtransfer's options.
from kvtransfer.channel import CHANNEL_OPTIONS as CHANNEL_OPTIONS
from kvtransfer.channel import MESSAGE_SIZE_OPTIONS
from services.common.serve_control import current_control
from services.common.tls import TlsConfig, add_port

# Message-size limits are kvtransfer's (the largest messages): one definition for both.
SERVER_OPTIONS = [*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)]


@dataclass
class BuiltServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def mark_serving(self) -> None:
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def mark_not_serving(self) -> None:
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)


def build_server(
    host: str, port: int, service_names: list[str], tls: TlsConfig | None = None
) -> BuiltServer:
    """`tls`: serve TLS (or mutual TLS) when it names a certificate; plaintext otherwise."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    bound = add_port(server, f"{host}:{port}", tls or TlsConfig())
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return BuiltServer(server, bound, health_servicer)


def announce_ready(**fields: object) -> None:
    """The one JSON line on stdout that tells a launcher (`pdserve up`, tests) we serve."""
    control = current_control()
    if control is not None:  # hosted in-process (a Ray actor): hand the fields over
        control.announce(fields)
    print(json.dumps(fields), flush=True)


async def wait_for_shutdown_signal() -> None:
    """Return once SIGTERM or SIGINT arrives (installed on the running event loop), or,
    for a service hosted in-process, once its host calls `ServeControl.request_stop`."""
    control = current_control()
    if control is not None:
        await control.wait_stop()
        return
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def wait_healthy(address: str, timeout: float) -> bool:
    """Poll the standard health service until SERVING or the timeout passes."""
    end = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    return False
