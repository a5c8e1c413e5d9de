"""The two sides of a KV transfer backend, so NIXL and the TCP fallback are swappable.

Exporter side (`ExportBackend`, prefill process): made once with the engine's KV pool;
`handshake_fields` fills what an importer needs to reach it; `poll_releases` returns the
lease ids that importers released through the backend's own channel (NIXL notifications).

Importer side (`ImportBackend`, decode process): `connect` is called once per exporter
incarnation with its handshake (and must drop any state of an earlier incarnation of the
same engine); `read` copies blocks from the exporter's pool into local blocks before a
deadline; `release` tells the exporter it may unpin the lease; `forget` drops a peer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from pdserve.v1 import common_pb2, kvtransfer_pb2


@dataclass(frozen=True)
class ReadResult:
    bytes: int
    descriptors: int
    seconds: float


class ExportBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def handshake_fields(self, response: kvtransfer_pb2.HandshakeResponse) -> None:
        """Fill agent name/metadata and pool address into a handshake response."""

    def poll_releases(self) -> list[str]:
        """Lease ids released through the backend since the last call."""
        return []

    def close(self) -> None:
        """Free backend resources (deregister memory)."""


class ImportBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def connect(self, peer_key: str, handshake: kvtransfer_pb2.HandshakeResponse) -> None:
        """Set up (or replace) the connection to one exporter incarnation."""

    @abc.abstractmethod
    def read(
        self,
        peer_key: str,
        handle: common_pb2.KvHandle,
        src_blocks: list[int],
        dst_blocks: list[int],
        deadline: float,
    ) -> ReadResult:
        """Copy exporter blocks `src_blocks` into local `dst_blocks` across all layers and
        K/V before `deadline` (monotonic). Raises TransferError subclasses."""

    @abc.abstractmethod
    def release(self, peer_key: str, handle: common_pb2.KvHandle, deadline: float) -> None:
        """Tell the exporter the lease's blocks may be unpinned (best effort)."""

    def forget(self, peer_key: str) -> None:
        """Drop a peer (it restarted or is gone)."""

    def close(self) -> None:
        """Free backend resources."""
