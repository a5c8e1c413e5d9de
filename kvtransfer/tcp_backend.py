"""The fallback backend: block bytes streamed over the exporter's KvTransfer gRPC service.

For platforms without NIXL (or UCX trouble). The exporter needs nothing beyond its
KvTransfer service (`ReadBlocks` streams whole blocks, a few per message, checking the
lease when it starts; the importer's Release call, answered with whether the lease was
still live, covers the rest of the read: `lease_release.py`). The importer keeps one
channel per exporter incarnation.
"""

from __future__ import annotations

import time

import grpc
import torch

from kvtransfer.backend import ExportBackend, ImportBackend, ReadResult
from kvtransfer.channel import PLAINTEXT, ChannelSecurity, PeerChannels
from kvtransfer.errors import LeaseExpiredError, TransferError
from kvtransfer.grpc_errors import transfer_error_from_rpc
from pdserve.v1 import common_pb2, kvtransfer_pb2


class TcpExportBackend(ExportBackend):
    name = "tcp"

    def handshake_fields(self, response: kvtransfer_pb2.HandshakeResponse) -> None:
        response.backends.append(self.name)


class TcpImportBackend(ImportBackend):
    """Reads block bytes with ReadBlocks and writes them into the local pool."""

    name = "tcp"

    def __init__(self, kv_blocks: torch.Tensor, security: ChannelSecurity = PLAINTEXT) -> None:
        self._pool = kv_blocks
        self._channels = PeerChannels(security)

    def connect(self, peer_key: str, handshake: kvtransfer_pb2.HandshakeResponse) -> None:
        self._channels.connect(peer_key, peer_key.split("|", 1)[0])

    def read(
        self,
        peer_key: str,
        handle: common_pb2.KvHandle,
        src_blocks: list[int],
        dst_blocks: list[int],
        deadline: float,
    ) -> ReadResult:
        start = time.monotonic()
        timeout = deadline - start
        if timeout <= 0:
            raise TransferError("no time left for the KV read")
        request = kvtransfer_pb2.ReadBlocksRequest(lease_id=handle.lease_id, block_ids=src_blocks)
        dst = torch.tensor(dst_blocks, dtype=torch.long, device=self._pool.device)
        total = chunks = received = 0
        try:
            for chunk in self._channels.stub(peer_key).ReadBlocks(request, timeout=timeout):
                self._store(chunk, dst)
                total += len(chunk.data)
                chunks += 1
                received += chunk.num_blocks
        except grpc.RpcError as exc:
            raise transfer_error_from_rpc(exc, f"KV read from {handle.transfer_address}") from exc
        if received != len(dst_blocks):
            raise LeaseExpiredError(f"KV read got {received} of {len(dst_blocks)} blocks")
        return ReadResult(total, chunks, time.monotonic() - start)

    def _store(self, chunk: kvtransfer_pb2.BlockChunk, dst: torch.Tensor) -> None:
        """Copy one message's whole blocks into their local blocks."""
        width = self._pool.shape[1]
        end = chunk.first_block + chunk.num_blocks
        if end > len(dst) or len(chunk.data) != chunk.num_blocks * width:
            raise TransferError(
                f"KV chunk of {chunk.num_blocks} blocks at {chunk.first_block} does not fit "
                f"the read ({len(dst)} blocks of {width} bytes)"
            )
        data = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(-1, width)
        self._pool.index_copy_(0, dst[chunk.first_block : end], data.to(self._pool.device))

    def forget(self, peer_key: str) -> None:
        self._channels.forget(peer_key)

    def close(self) -> None:
        self._channels.close()
