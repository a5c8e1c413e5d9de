"""The importing side of the transfer benchmark: backend links and the copy baseline.

Lifecycle: `connect` handshakes one exporter and connects a `NixlImportBackend` or
`TcpImportBackend` to it over this process's own pool, exactly as `KvImporter` does; the
`Link` it returns is used for every import of the run (`timed_import`: read, then
release, each timed; `timed_checked_import`: the same read cut into chunks and checked
against the handle's checksums, as `KvImporter` reads) and closed by the caller.
`CopyBaseline` holds two preallocated huge-page-advised buffers for the in-process
copies the transfers are measured against: a single-thread libc memcpy of the same
number of bytes (the baseline) and torch `copy_` (context).
"""

from __future__ import annotations

import ctypes
import time
import uuid
from dataclasses import dataclass

import torch

from engine.kv_layout import KvLayout, allocate_blocks
from kvtransfer.backend import ImportBackend, ReadResult
from kvtransfer.checked_read import CheckedRead, ReadChecker
from kvtransfer.errors import LeaseExpiredError
from kvtransfer.importer import handshake, handshake_offer
from kvtransfer.layout import check_layout
from kvtransfer.lease_release import LeaseReleaser
from kvtransfer.tcp_backend import TcpImportBackend
from loadtest.transfer.exporter import CPU
from pdserve.v1 import common_pb2

IMPORT_TIMEOUT_S = 30.0


@dataclass
class Link:
    """One connected import backend (what KvImporter holds per exporter incarnation)."""

    backend: ImportBackend
    peer_key: str
    releaser: LeaseReleaser


def connect(
    name: str, layout: KvLayout, pool: torch.Tensor, address: str, timeout_s: float
) -> Link:
    agent_name = f"bench-importer-{name}.{uuid.uuid4().hex[:12]}"
    backend: ImportBackend
    if name == "nixl":
        # Imported here: NIXL is an optional dependency, loaded only when measured.
        from kvtransfer.nixl_backend import NixlImportBackend

        backend = NixlImportBackend(pool, agent_name)
    else:
        backend = TcpImportBackend(pool)
    response = handshake(address, handshake_offer(layout, agent_name), time.monotonic() + timeout_s)
    check_layout(layout, response.layout)
    peer_key = f"{address}|{response.incarnation}"
    backend.connect(peer_key, response)
    releaser = LeaseReleaser()
    releaser.connect(peer_key, address)
    return Link(backend, peer_key, releaser)


def timed_import(
    link: Link, handle: common_pb2.KvHandle, src: list[int], dst: list[int]
) -> tuple[ReadResult, float, float]:
    """One import: (result, read seconds, read + release seconds)."""
    deadline = time.monotonic() + IMPORT_TIMEOUT_S
    t0 = time.perf_counter()
    result = link.backend.read(link.peer_key, handle, src, dst, deadline)
    t1 = time.perf_counter()
    if not link.releaser.release(link.peer_key, handle, deadline):
        raise LeaseExpiredError(f"lease {handle.lease_id} ended during the timed read")
    return result, t1 - t0, time.perf_counter() - t0


def timed_checked_import(
    link: Link, checker: ReadChecker, handle: common_pb2.KvHandle, src: list[int], dst: list[int]
) -> tuple[CheckedRead, float]:
    """One import checked block by block: (what the checker saw, read + check seconds).
    Its lease is released after the clock stops, as in `timed_import`."""
    deadline = time.monotonic() + IMPORT_TIMEOUT_S

    def read(src: list[int], dst: list[int]) -> ReadResult:
        return link.backend.read(link.peer_key, handle, src, dst, deadline)

    t0 = time.perf_counter()
    checked = checker.read(read, src, dst, handle.block_checksums)
    seconds = time.perf_counter() - t0
    if not link.releaser.release(link.peer_key, handle, deadline):
        raise LeaseExpiredError(f"lease {handle.lease_id} ended during the timed read")
    return checked, seconds


class CopyBaseline:
    """Single-thread in-process copies between two preallocated huge-page-advised buffers."""

    def __init__(self, source: torch.Tensor, layout: KvLayout, max_blocks: int) -> None:
        self._src = source.view(-1)
        self._dst = allocate_blocks(layout, max_blocks, CPU).view(-1)

    def memcpy(self, nbytes: int) -> float:
        """libc memmove (glibc's memcpy code), the machine's plain copy."""
        t0 = time.perf_counter()
        ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), nbytes)
        return time.perf_counter() - t0

    def torch_copy(self, nbytes: int) -> float:
        n = nbytes // self._src.element_size()
        t0 = time.perf_counter()
        self._dst[:n].copy_(self._src[:n])
        return time.perf_counter() - t0
