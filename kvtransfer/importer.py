"""The decode side of KV transfer: pull a request's blocks from a prefill engine.

The importer sees its engine only through `ImportPort` (kvtransfer/engine_port.py).
Lifecycle of one `import_kv(handle, spec)`: check the handle against this engine's
layout and the prompt; make sure the exporter's current incarnation has been handshaken
(once per incarnation, however many imports arrive together: a restarted exporter's
stale NIXL metadata is dropped and the handshake redone); reserve blocks in the engine
(WAITING_FOR_REMOTE_KV), reusing blocks already in its prefix cache so only the missing
ones are read; read them before the deadline, in chunks, each block checked against the
exporter's checksum while the next chunk is read (`checked_read.py`), re-reading once the
blocks that differ (KvCorruptionError if they differ again); release the exporter's
lease, whose answer says whether the lease was held for the whole read (`LeaseReleaser`:
a one-sided read cannot be checked by the exporter, and a lease that ended mid-read may
have let the engine reuse the blocks for another request); only then commit the request
to the engine's batch (or learn why its first token already ended it: the result's
`finish_reason`). A lease found ended discards the bytes read (LeaseExpiredError: the
gateway prefills the request again). Any failure cancels the reservation (nothing leaks
here) and raises a typed TransferError; the exporter's lease expiry covers its side.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc
import torch

from engine.errors import OutOfBlocksError
from engine.finish_reason import FinishReason
from engine.kv_layout import KvLayout
from engine.request_spec import RequestSpec
from kvtransfer.backend import ImportBackend, ReadResult
from kvtransfer.channel import PLAINTEXT, ChannelSecurity, dial
from kvtransfer.checked_read import CheckedRead, ReadChecker
from kvtransfer.config import TransferConfig
from kvtransfer.engine_port import ImportPort
from kvtransfer.errors import (
    InvalidHandleError,
    KvCorruptionError,
    LeaseExpiredError,
    NoBlocksError,
    PeerUnavailableError,
    TransferError,
)
from kvtransfer.fault import BitFlips
from kvtransfer.grpc_errors import transfer_error_from_rpc
from kvtransfer.handle import PROTOCOL_VERSION, handle_adapter, validate_handle
from kvtransfer.layout import check_layout, layout_to_proto
from kvtransfer.lease_release import LeaseReleaser
from kvtransfer.tcp_backend import TcpImportBackend
from pdserve.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc

log = logging.getLogger(__name__)


def make_import_backend(
    name: str, kv_blocks: torch.Tensor, agent_name: str, security: ChannelSecurity = PLAINTEXT
) -> ImportBackend:
    if name == "nixl":
        # Imported here: NIXL is an optional dependency, loaded only when chosen.
        from kvtransfer.nixl_backend import NixlImportBackend

        return NixlImportBackend(kv_blocks, agent_name)
    return TcpImportBackend(kv_blocks, security)


def handshake_offer(layout: KvLayout, agent_name: str) -> kvtransfer_pb2.HandshakeRequest:
    """What an importer tells an exporter about itself: protocol, layout, NIXL agent."""
    return kvtransfer_pb2.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=layout.fingerprint(),
        importer_agent_name=agent_name,
        layout=layout_to_proto(layout),
    )


def handshake(
    address: str,
    offer: kvtransfer_pb2.HandshakeRequest,
    deadline: float,
    metadata: Sequence[tuple[str, str]] = (),
    security: ChannelSecurity = PLAINTEXT,
) -> kvtransfer_pb2.HandshakeResponse:
    """Ask the exporter at `address` who it is; it refuses a protocol or layout mismatch
    in `offer` (`handshake_offer`). `metadata` rides on the call (the request's trace
    context)."""
    timeout = max(deadline - time.monotonic(), 0.05)
    with dial(address, security) as channel:
        try:
            response: kvtransfer_pb2.HandshakeResponse = kvtransfer_pb2_grpc.KvTransferStub(
                channel
            ).Handshake(offer, timeout=timeout, metadata=tuple(metadata) or None)
        except grpc.RpcError as exc:
            raise transfer_error_from_rpc(exc, f"KV handshake with {address}") from exc
    return response


@dataclass(frozen=True)
class ImportResult:
    num_cached_blocks: int
    num_read_blocks: int
    bytes: int
    descriptors: int
    seconds: float
    # None: the request was queued to decode; else why its first token already ended it.
    finish_reason: FinishReason | None = None
    # Blocks whose first read failed its checksum (each re-read and then matched).
    checksum_mismatches: int = 0
    verify_seconds: float = 0.0

    @property
    def queued(self) -> bool:
        return self.finish_reason is None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KvImporter:
    """Moves exported KV into this engine and queues the request for decode."""

    def __init__(
        self,
        engine: ImportPort,
        config: TransferConfig,
        *,
        engine_id: str | None = None,
        security: ChannelSecurity = PLAINTEXT,
        flips: BitFlips | None = None,
    ) -> None:
        """`flips` corrupts reads on purpose, for tests (`kvtransfer/fault.py`; default:
        as `PDSERVE_TEST_KV_BIT_FLIPS` says, normally never)."""
        self.engine = engine
        self.config = config
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.agent_name = f"{self.engine_id}.{uuid.uuid4().hex[:12]}"
        self.security = security
        self.backend = make_import_backend(
            config.kv_backend, engine.kv_blocks, self.agent_name, security
        )
        self.releaser = LeaseReleaser(security)
        self._lock = threading.Lock()
        self._peer_by_address: dict[str, str] = {}  # address -> "address|incarnation"
        self._peer_blocks: dict[str, int] = {}  # peer key -> blocks in its pool
        self._handshaking: dict[str, threading.Lock] = {}  # address -> its handshake's lock
        self.handshakes = 0
        self.checker = ReadChecker(
            engine.kv_blocks, flips if flips is not None else BitFlips.from_env()
        )

    def import_kv(
        self,
        handle: common_pb2.KvHandle,
        spec: RequestSpec,
        *,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> ImportResult:
        """Bring the handle's KV in and queue `spec` to decode; raises TransferError
        subclasses. `metadata` goes on the gRPC calls to the exporter (W3C trace context);
        the request joins the batch at its class with its deadline (the transfer has its
        own, shorter one: `timeout_s`, else the config's). A migrated stream imports its
        prompt's KV and goes on after `spec.resume_token_ids`. The handle's KV must have
        been computed with this worker's copy of the spec's LoRA adapter
        (AdapterMismatchError, before any block is reserved or read)."""
        start = time.monotonic()
        named = "" if spec.adapter is None else spec.adapter.name
        spec = replace(spec, adapter=handle_adapter(handle, named))
        deadline = start + (timeout_s or self.config.kv_transfer_timeout_s)
        validate_handle(
            handle,
            self.engine.layout,
            spec.prompt_token_ids,
            self.backend.name,
            checksums=self.config.kv_checksum,
        )
        peer = self._peer(handle, deadline, metadata)
        self._check_block_ids(handle, peer)
        try:
            slot = self.engine.reserve_import(
                spec, handle.first_token_id, list(handle.fork_token_ids)
            )
        except OutOfBlocksError as exc:
            raise NoBlocksError(str(exc)) from exc
        request_id = spec.request_id
        try:
            first = slot.num_cached_blocks
            src = list(handle.block_ids[first:])
            read = None
            if src:
                read = self._read_blocks(peer, handle, first, slot.blocks_to_fill, deadline)
            held = self.releaser.release(peer, handle, deadline)
            if src and not held:
                raise LeaseExpiredError(
                    f"KV lease {handle.lease_id} at {handle.transfer_address} ended during "
                    "the read (expired or cancelled): its blocks may have been reused, so the "
                    "bytes read are discarded"
                )
            ended = self.engine.commit_import(request_id)
        except PeerUnavailableError:
            self.engine.cancel_import(request_id)
            # The exporter died or restarted: its metadata is stale, re-handshake next time.
            self._drop_peer(handle.transfer_address, peer)
            raise
        except BaseException:
            self.engine.cancel_import(request_id)
            raise
        return ImportResult(
            num_cached_blocks=slot.num_cached_blocks,
            num_read_blocks=len(src),
            bytes=read.result.bytes if read else 0,
            descriptors=read.result.descriptors if read else 0,
            seconds=time.monotonic() - start,
            finish_reason=ended,
            checksum_mismatches=read.mismatches if read else 0,
            verify_seconds=read.verify_seconds if read else 0.0,
        )

    def _read_blocks(
        self, peer: str, handle: common_pb2.KvHandle, first: int, dst: list[int], deadline: float
    ) -> CheckedRead:
        """Read the handle's blocks from index `first` on into `dst` and check each against
        its checksum (unless this worker runs with kv_checksum off); on corruption the
        lease is given back at once: blocks that failed twice are no use to anyone, and a
        lease left out pins them until it expires."""
        src, checksums = list(handle.block_ids[first:]), handle.block_checksums[first:]

        def read(src: list[int], dst: list[int]) -> ReadResult:
            return self.backend.read(peer, handle, src, dst, deadline)

        if not self.config.kv_checksum:
            return self.checker.read_unchecked(read, src, dst)
        try:
            return self.checker.read(read, src, dst, checksums)
        except KvCorruptionError as exc:
            try:
                self.releaser.release(peer, handle, deadline)
            except TransferError as release_error:  # expiry ends it; corruption is the news
                log.warning("KV lease %s not released: %s", handle.lease_id, release_error)
            raise KvCorruptionError(
                f"KV from {handle.transfer_address}: {exc}; the bytes are discarded"
            ) from exc

    def _peer(
        self, handle: common_pb2.KvHandle, deadline: float, metadata: Sequence[tuple[str, str]]
    ) -> str:
        address = handle.transfer_address
        key = f"{address}|{handle.incarnation}"
        with self._lock:
            if self._peer_by_address.get(address) == key:
                return key
            handshaking = self._handshaking.setdefault(address, threading.Lock())
        # One handshake per address at a time: imports that arrive together at a new
        # exporter wait for the first one's. Two handshakes would each connect the key,
        # and the second connect closes the channel the first import is already using.
        with handshaking:
            with self._lock:
                if self._peer_by_address.get(address) == key:
                    return key
            return self._handshake(address, key, handle, deadline, metadata)

    def _handshake(
        self,
        address: str,
        key: str,
        handle: common_pb2.KvHandle,
        deadline: float,
        metadata: Sequence[tuple[str, str]],
    ) -> str:
        offer = handshake_offer(self.engine.layout, self.agent_name)
        response = handshake(address, offer, deadline, metadata, self.security)
        if response.incarnation != handle.incarnation:
            raise LeaseExpiredError(
                f"KV exporter at {address} restarted (incarnation {response.incarnation}, "
                f"handle has {handle.incarnation}); its blocks are gone"
            )
        check_layout(self.engine.layout, response.layout, "importer", "exporter")
        with self._lock:
            old = self._peer_by_address.get(address)
            if old is not None and old != key:
                log.info("KV exporter at %s has a new incarnation; re-handshaking", address)
                self._peer_blocks.pop(old, None)
                self.backend.forget(old)
                self.releaser.forget(old)
            self.backend.connect(key, response)
            self.releaser.connect(key, address)
            self._peer_by_address[address] = key
            self._peer_blocks[key] = response.num_blocks
            self.handshakes += 1
        return key

    def _check_block_ids(self, handle: common_pb2.KvHandle, peer: str) -> None:
        """Every id must name a block of the exporter's pool: a larger one would address
        another layer's block (a silent wrong read) or past the pool (a NIXL error)."""
        with self._lock:
            pool = self._peer_blocks.get(peer, 0)
        if pool and any(b >= pool for b in handle.block_ids):
            raise InvalidHandleError(
                f"kv_handle.block_ids: every id must be < {pool}, the exporter's pool size"
            )

    def _drop_peer(self, address: str, key: str) -> None:
        with self._lock:
            if self._peer_by_address.get(address) == key:
                del self._peer_by_address[address]
                self._peer_blocks.pop(key, None)
                self.backend.forget(key)
                self.releaser.forget(key)

    def close(self) -> None:
        self.checker.close()
        self.backend.close()
        self.releaser.close()
