"""The prefill side of KV transfer: export held blocks under leases and serve importers.

Lifecycle: `KvExporter(port, config)` (any `ExportPort`, an engine's `handoff`: the
exporter never sees the engine beyond it) registers the engine's KV pool with the backend
(NIXL registers it once, for the process's life) and `start()` binds the KvTransfer gRPC
service on loopback and starts a housekeeping thread. After the engine finishes a
request added with `hold_kv=True`, `export(request_id)` grants a lease and returns the
KvHandle that travels to the decode side. The lease ends exactly once: on the
importer's Release call (answered with whether the lease was still live, which the
importer needs before it commits a one-sided read), on `cancel(request_id)`,
or on expiry (counted); each end unpins the blocks in the engine, whose full blocks stay
in its prefix cache. `close()` ends all leases, stops the server and frees the backend.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from kvtransfer.backend import ExportBackend
from kvtransfer.channel import CHANNEL_OPTIONS, PLAINTEXT, ChannelSecurity, bind
from kvtransfer.checksum import block_checksums
from kvtransfer.config import TransferConfig
from kvtransfer.engine_port import ExportPort
from kvtransfer.handle import PROTOCOL_VERSION
from kvtransfer.leases import LeaseStats, LeaseTable
from kvtransfer.service import KvTransferService, ServedPool
from kvtransfer.tcp_backend import TcpExportBackend
from pdserve.v1 import common_pb2, kvtransfer_pb2_grpc

log = logging.getLogger(__name__)

#: How often leases are checked for expiry.
HOUSEKEEPING_INTERVAL_S = 0.005


def make_export_backend(name: str, kv_blocks: torch.Tensor, agent_name: str) -> ExportBackend:
    if name == "nixl":
        # Imported here: NIXL is an optional dependency, loaded only when chosen.
        from kvtransfer.nixl_backend import NixlExportBackend

        return NixlExportBackend(kv_blocks, agent_name)
    return TcpExportBackend()


@dataclass(frozen=True)
class ExporterStats:
    leases: LeaseStats
    address: str
    backend: str


class KvExporter:
    """Leases on a prefill engine's held blocks, plus the service importers talk to."""

    def __init__(
        self,
        port: ExportPort,
        config: TransferConfig,
        *,
        engine_id: str | None = None,
        security: ChannelSecurity = PLAINTEXT,
    ) -> None:
        """Serve `port`'s held blocks (an engine's `handoff`, or a bare pool)."""
        layout, kv_blocks = port.layout, port.kv_blocks
        self.held = port
        self.config = config
        self.layout = layout
        self.kv_blocks = kv_blocks
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        # A new incarnation per process start: importers must re-handshake after a restart.
        self.incarnation = uuid.uuid4().hex[:12]
        self.agent_name = f"{self.engine_id}.{self.incarnation}"
        self.leases = LeaseTable(config.kv_lease_ttl_s, on_release=port.release_held)
        self.backend = make_export_backend(config.kv_backend, kv_blocks, self.agent_name)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS
        )
        served = ServedPool(
            self.engine_id, self.incarnation, layout, kv_blocks, self.backend, self.leases
        )
        service = KvTransferService(served)
        kvtransfer_pb2_grpc.add_KvTransferServicer_to_server(service, self._server)
        host = config.kv_transfer_host
        bound = bind(self._server, f"{host}:{config.kv_transfer_port}", security)
        self.address = f"{host}:{bound}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._housekeeping, name="kv-exporter", daemon=True)

    def start(self) -> KvExporter:
        self._server.start()
        self._thread.start()
        log.info(
            "KV exporter %s (%s) serving on %s", self.agent_name, self.backend.name, self.address
        )
        return self

    def export(self, request_id: str) -> common_pb2.KvHandle:
        """Lease the held blocks of a finished hold_kv request and describe them, with a
        checksum per block unless the config turns them off. Hashing reads every byte
        (it releases the GIL): call it off an event loop."""
        held = self.held.held_kv(request_id)
        checksums = (
            block_checksums(self.kv_blocks, held.block_ids) if self.config.kv_checksum else []
        )
        lease = self.leases.grant(request_id, held.block_ids)
        return common_pb2.KvHandle(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            agent_name=self.agent_name,
            transfer_address=self.address,
            block_ids=held.block_ids,
            num_tokens=held.num_tokens,
            layout_fingerprint=self.layout.fingerprint(),
            lease_id=lease.lease_id,
            lease_expiry_unix_ms=lease.expires_at_unix_ms,
            backend=self.backend.name,
            first_token_id=held.first_token_id,
            fork_token_ids=held.fork_token_ids,
            request_id=request_id,
            adapter_digest=held.adapter_digest,
            block_checksums=checksums,
        )

    def cancel(self, request_id: str) -> bool:
        """Drop a request's lease at once (its client went away before decode)."""
        return self.leases.release_request(request_id)

    def stats(self) -> ExporterStats:
        return ExporterStats(self.leases.stats(), self.address, self.backend.name)

    def _housekeeping(self) -> None:
        while not self._stop.wait(HOUSEKEEPING_INTERVAL_S):
            try:
                expired = self.leases.expire_due()
                if expired:
                    log.warning("%d KV lease(s) expired without a release", expired)
            except Exception:  # keep the thread alive: a stuck lease would strand KV
                log.exception("KV exporter housekeeping failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._server.stop(grace=0.5).wait()
        self.leases.release_all()
        self.backend.close()
