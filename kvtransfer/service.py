"""The exporter's KvTransfer gRPC service: handshake, fallback block reads, releases.

Runs inside the prefill process next to its engine, made by the exporter with the
`ServedPool` it serves (it knows nothing else of the exporter). Handshake answers with
the engine's identity (engine id + incarnation), layout and the backend's connection
fields, after refusing a protocol or layout mismatch. ReadBlocks serves only blocks
under an active lease; Release ends a lease early.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import torch

from engine.kv_layout import KvLayout
from kvtransfer.backend import ExportBackend
from kvtransfer.handle import PROTOCOL_VERSION
from kvtransfer.layout import layout_differences, layout_to_proto
from kvtransfer.leases import LeaseTable
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

#: Bytes of blocks per ReadBlocks message (at least one block): big enough that
#: per-message overhead vanishes, small enough to stream while the importer copies.
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class ServedPool:
    """One exporter incarnation's pool, as the service answers about it and reads it."""

    engine_id: str
    incarnation: str
    layout: KvLayout
    kv_blocks: torch.Tensor
    backend: ExportBackend
    leases: LeaseTable


class KvTransferService(kvtransfer_pb2_grpc.KvTransferServicer):
    def __init__(self, served: ServedPool) -> None:
        self._exp = served

    def Handshake(
        self, request: kvtransfer_pb2.HandshakeRequest, context: grpc.ServicerContext
    ) -> kvtransfer_pb2.HandshakeResponse:
        exp = self._exp
        if request.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol_version {request.protocol_version} is not supported "
                f"(exporter speaks {PROTOCOL_VERSION})",
            )
        if request.layout_fingerprint != exp.layout.fingerprint():
            if request.HasField("layout"):
                detail = layout_differences(exp.layout, request.layout, "exporter", "importer")
            else:  # an importer from before the layout rode along
                detail = f"exporter: {exp.layout.describe()}"
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layout_fingerprint: the importer's KV layout differs from the exporter's "
                f"({detail})",
            )
        response = kvtransfer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            engine_id=exp.engine_id,
            incarnation=exp.incarnation,
            layout=layout_to_proto(exp.layout),
            num_blocks=exp.kv_blocks.shape[0],
        )
        exp.backend.handshake_fields(response)
        return response

    def ReadBlocks(
        self, request: kvtransfer_pb2.ReadBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[kvtransfer_pb2.BlockChunk]:
        lease = self._exp.leases.get(request.lease_id)
        if lease is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"lease {request.lease_id} is not active")
            return
        allowed = set(lease.block_ids)
        if not request.block_ids or any(b not in allowed for b in request.block_ids):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "block_ids: must be blocks of the lease"
            )
        pool = self._exp.kv_blocks
        ids = list(request.block_ids)
        per_chunk = max(1, CHUNK_BYTES // pool.shape[1])
        for first in range(0, len(ids), per_chunk):
            index = torch.tensor(ids[first : first + per_chunk], dtype=torch.long)
            data = pool.index_select(0, index.to(pool.device)).cpu().numpy().tobytes()
            yield kvtransfer_pb2.BlockChunk(first_block=first, num_blocks=len(index), data=data)

    def Release(
        self, request: kvtransfer_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> kvtransfer_pb2.ReleaseResponse:
        return kvtransfer_pb2.ReleaseResponse(released=self._exp.leases.release(request.lease_id))
