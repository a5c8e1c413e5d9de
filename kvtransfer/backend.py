"""The two sides of a KV transfer backend, so NIXL and the TCP fallback are swappable.

Exporter side (`ExportBackend`, prefill process): made once with the engine's KV pool;
`handshake_fields` fills what an importer needs to reach it.

Importer side (`ImportBackend`, decode process): `connect` is called once per exporter
incarnation with its handshake (and must drop any state of an earlier incarnation of the
same engine); `read` copies blocks from the exporter's pool into local blocks before a
deadline; `forget` drops a peer. Releasing the lease is not the backend's: the importer
does it with a Release call whose answer proves the read (`lease_release.py`).
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

    def forget(self, peer_key: str) -> None:
        """Drop a peer (it restarted or is gone)."""

    def close(self) -> None:
        """Free backend resources."""
