"""The gateway's connections to workers, and the cleanups that outlive a request's task.

Lifecycle: the gateway builds one `WorkerStubs` at start. `stubs[address]` opens a
channel to a worker on first use (membership changes while the gateway runs) and keeps
it. Request records (`services.gateway.stream.request_record`) run their cleanup in `cleanups`,
so it reaches its end however the request's task ends. `close()` at shutdown gives the
unfinished cleanups a moment (their Abort calls need the channels), then closes the
channels.
"""

from __future__ import annotations

import grpc

from pdserve.v1 import worker_pb2_grpc
from services.common.detached import Detached
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.tls import TlsConfig, open_aio_channel

CLEANUP_GRACE_S = 3.0  # at shutdown: request cleanups still running (an Abort is <= 2 s)


class WorkerStubs:
    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.tls = tls or TlsConfig()
        self.cleanups = Detached()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def __getitem__(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_aio_channel(address, self.tls, CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        await self.cleanups.close(CLEANUP_GRACE_S)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
