"""The NIXL backend (nixl-cu12, UCX): one-sided READs of registered KV pools.

Exporter: registers its whole KV pool once (one registration for the process's life)
and hands out its agent metadata and pool address at handshake. It never sees a READ.

Importer: registers its pool once and prepares a descriptor list with one entry per
block (the pool is block-major: a block's KV of every layer, with its scales, is one
contiguous row). Per exporter incarnation it loads the peer's metadata and prepares the
peer's block list once. A transfer is then one `make_prepped_xfer` READ with index
arrays, one descriptor per block; NIXL merges runs of adjacent blocks into one. The
lease is released afterwards by the importer's Release call, whose answer proves the
lease held for the whole read (`lease_release.py`). A restarted exporter has a new
agent name (engine id + incarnation): its old metadata and prepared list are dropped
before the new ones load.

Settings (found on 2-core CPU hosts with UCX over CMA): no UCX progress thread (the
binding's thread busy-polls a whole core); UCX error handling mode "none", so a READ
completes without the exporter's progress; the importer progresses transfers by
polling `check_xfer_state`.
Splitting one large READ over two threads (two CMA copies at once) was tried and was
not faster here. Agents use read-write thread sync because gRPC handler threads share
them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from kvtransfer.backend import ExportBackend, ImportBackend, ReadResult
from kvtransfer.errors import PeerUnavailableError, TransferTimeoutError
from pdserve.v1 import common_pb2, kvtransfer_pb2


def _nixl() -> Any:
    import nixl_cu12

    # nixl installs an INFO handler on stdout, which would interleave with a CLI's
    # output; route its records through the process's own logging config instead.
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)
    return nixl_cu12


def _new_agent(name: str) -> Any:
    nixl = _nixl()
    config = nixl.nixl_agent_config(
        enable_prog_thread=False,
        backends=[],
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    )
    agent = nixl.nixl_agent(name, config)
    # UCX's "peer" error mode routes every READ's completion through the exporter's
    # progress (a 5 ms poll here): one-block imports took ~5 ms. Mode "none" completes
    # one-sided CMA reads without the exporter (~0.2 ms), and a dead exporter still
    # fails the READ at once (CMA reports the vanished process).
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def _mem_type(pool: torch.Tensor) -> str:
    return "VRAM" if pool.is_cuda else "DRAM"


def block_descriptors(base: int, blocks: int, block_bytes: int, device: int) -> np.ndarray:
    """[N, 3] (address, length, device) of every block of a pool; block b is row b."""
    descs = np.empty((blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device
    return descs


class NixlExportBackend(ExportBackend):
    name = "nixl"

    def __init__(self, kv_blocks: torch.Tensor, agent_name: str) -> None:
        self._pool = kv_blocks
        self._agent_name = agent_name
        self._agent = _new_agent(agent_name)
        self._reg = self._agent.register_memory(kv_blocks)

    def handshake_fields(self, response: kvtransfer_pb2.HandshakeResponse) -> None:
        response.agent_name = self._agent_name
        response.agent_metadata = self._agent.get_agent_metadata()
        response.pool_base_address = self._pool.data_ptr()
        response.device_id = self._pool.device.index or 0
        response.backends.append(self.name)

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None


class _Peer:
    def __init__(self, name: str, prepped: Any) -> None:
        self.name = name
        self.prepped = prepped


class NixlImportBackend(ImportBackend):
    name = "nixl"

    def __init__(self, kv_blocks: torch.Tensor, agent_name: str) -> None:
        self._pool = kv_blocks
        self._block_bytes = kv_blocks.shape[1]
        self._device = kv_blocks.device.index or 0
        self._agent = _new_agent(agent_name)
        self._reg = self._agent.register_memory(kv_blocks)
        local = block_descriptors(
            kv_blocks.data_ptr(), kv_blocks.shape[0], self._block_bytes, self._device
        )
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, _mem_type(kv_blocks))
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}

    def connect(self, peer_key: str, handshake: kvtransfer_pb2.HandshakeResponse) -> None:
        raw = self._agent.add_remote_agent(handshake.agent_metadata)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        remote = block_descriptors(
            handshake.pool_base_address, handshake.num_blocks, self._block_bytes,
            handshake.device_id,
        )  # fmt: skip
        prepped = self._agent.prep_xfer_dlist(name, remote, _mem_type(self._pool))
        with self._lock:
            self._peers[peer_key] = _Peer(name, prepped)

    def _peer(self, peer_key: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(peer_key)
        if peer is None:
            raise PeerUnavailableError(f"no NIXL connection to KV exporter {peer_key}")
        return peer

    def read(
        self,
        peer_key: str,
        handle: common_pb2.KvHandle,
        src_blocks: list[int],
        dst_blocks: list[int],
        deadline: float,
    ) -> ReadResult:
        peer = self._peer(peer_key)
        start = time.monotonic()
        local_idx = np.asarray(dst_blocks, dtype=np.int32)
        remote_idx = np.asarray(src_blocks, dtype=np.int32)
        # No release notification rides on the read: the importer releases with a call
        # whose answer says whether the lease held for the whole read (lease_release.py).
        try:
            xfer = self._agent.make_prepped_xfer(
                "READ", self._local, local_idx, peer.prepped, remote_idx
            )  # fmt: skip
        except Exception as exc:
            # Another import's failed read can forget this peer (its exporter died)
            # between our lookup and here: NIXL then refuses the released descriptors
            # (NIXL_ERR_INVALID_PARAM), which means the same as a dead peer.
            raise PeerUnavailableError(
                f"KV read from {handle.transfer_address} could not start: {exc}"
            ) from exc
        try:
            self._wait(xfer, deadline, handle.transfer_address)
        finally:
            xfer.release()
        nbytes = len(local_idx) * self._block_bytes
        return ReadResult(nbytes, len(local_idx), time.monotonic() - start)

    def _wait(self, xfer: Any, deadline: float, address: str) -> None:
        try:
            state = self._agent.transfer(xfer)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"KV read from {address} passed its deadline")
                state = self._agent.check_xfer_state(xfer)
        except TransferTimeoutError:
            raise
        except Exception as exc:  # nixl raises its own error types on a dead peer
            raise PeerUnavailableError(f"KV read from {address} failed: {exc}") from exc
        if state != "DONE":
            raise PeerUnavailableError(f"KV read from {address} ended in state {state}")

    def forget(self, peer_key: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_key, None)
        if peer is None:
            return
        peer.prepped.release()
        self._agent.remove_remote_agent(peer.name)

    def close(self) -> None:
        for key in list(self._peers):
            self.forget(key)
        if self._reg is not None:
            self._local.release()
            self._agent.deregister_memory(self._reg)
            self._reg = None
