"""Reading a request's KV blocks and checking each against the exporter's checksum.

Hashing every byte after the read would add a large share of the read's time again
(docs/kvtransfer.md has the numbers). So the read is cut into chunks, and a hashing
thread checks chunk k while chunk k+1 is read; what is left exposed is the last chunk's
hash, one read call per chunk, and the two threads sharing the memory bus. Chunks are a
third of what is left, between MIN_CHUNK_BYTES and MAX_CHUNK_BYTES, so the last ones,
whose hashes nothing overlaps, are small; a read of at most MIN_CHUNK_BYTES is one call.
`transfer_bench` measures the cost.

Blocks that differ are read once more (a fault in transit need not repeat) and checked
again; KvCorruptionError if any still differs. The fault hook (`fault.BitFlips`) acts
after each read call, before its hash, as a fault in transit would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtransfer.backend import ReadResult
from kvtransfer.checksum import mismatched
from kvtransfer.errors import KvCorruptionError
from kvtransfer.fault import BitFlips

log = logging.getLogger(__name__)

#: The smallest chunk worth a read call of its own, and the largest (see the docstring).
MIN_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 48 << 20
#: Imports check in parallel with each other too; more threads than cores buys nothing.
HASH_THREADS = 2

#: Copies `src` exporter blocks into local `dst` blocks (an `ImportBackend.read` bound to
#: one peer, handle and deadline).
ReadBlocks = Callable[[list[int], list[int]], ReadResult]


@dataclass(frozen=True)
class CheckedRead:
    """One import's read: its totals, the blocks re-read, and the seconds the reader
    waited for hashes after its last read call (the cost nothing overlapped)."""

    result: ReadResult
    mismatches: int
    verify_seconds: float


def chunk_bounds(num_blocks: int, block_bytes: int) -> list[tuple[int, int]]:
    """[start, end) block ranges covering `num_blocks`, each a third of what is left,
    clamped to [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES] (at least one block)."""
    low = max(1, MIN_CHUNK_BYTES // block_bytes)
    high = max(low, MAX_CHUNK_BYTES // block_bytes)
    bounds, start = [], 0
    while start < num_blocks:
        size = min(max((num_blocks - start) // 3, low), high, num_blocks - start)
        bounds.append((start, start + size))
        start += size
    return bounds


class ReadChecker:
    """Reads and checks blocks into one pool; shared by all of an importer's imports."""

    def __init__(self, kv_blocks: torch.Tensor, flips: BitFlips) -> None:
        self.kv_blocks = kv_blocks
        self.flips = flips
        self._hasher = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kv-checksum")

    def read(
        self, read: ReadBlocks, src: list[int], dst: list[int], checksums: Sequence[int]
    ) -> CheckedRead:
        """Read `src` into `dst`, checking each block against `checksums` (same order);
        KvCorruptionError naming the first block that differs after its re-read."""
        result, bad, waited = self._overlapped(read, src, dst, checksums)
        if not bad:
            return CheckedRead(result, 0, waited)
        log.warning(
            "%d of %d KV blocks failed their checksum; reading them again", len(bad), len(src)
        )
        again_src, again_dst = [src[i] for i in bad], [dst[i] for i in bad]
        self._read(read, again_src, again_dst)
        start = time.monotonic()
        still = mismatched(self.kv_blocks, again_dst, [checksums[i] for i in bad])
        waited += time.monotonic() - start
        if still:
            raise KvCorruptionError(
                f"{len(still)} of {len(src)} blocks differ from the exporter's checksums "
                f"after a re-read (first: exporter block {again_src[still[0]]})"
            )
        return CheckedRead(result, len(bad), waited)

    def read_unchecked(self, read: ReadBlocks, src: list[int], dst: list[int]) -> CheckedRead:
        """One read call, nothing hashed (checksums off)."""
        return CheckedRead(self._read(read, src, dst), 0, 0.0)

    def _overlapped(
        self, read: ReadBlocks, src: list[int], dst: list[int], checksums: Sequence[int]
    ) -> tuple[ReadResult, list[int], float]:
        """Chunked reads, each chunk hashed while the next is read; returns the totals,
        the indexes of blocks that differ, and the seconds spent waiting for hashes."""
        pending: list[tuple[int, Future[list[int]]]] = []
        total = ReadResult(0, 0, 0.0)
        try:
            for start, end in chunk_bounds(len(src), self.kv_blocks.shape[1]):
                part = self._read(read, src[start:end], dst[start:end])
                total = ReadResult(
                    total.bytes + part.bytes,
                    total.descriptors + part.descriptors,
                    total.seconds + part.seconds,
                )
                check = self._hasher.submit(
                    mismatched, self.kv_blocks, dst[start:end], checksums[start:end]
                )
                pending.append((start, check))
            waiting = time.monotonic()
            bad = [start + i for start, check in pending for i in check.result()]
            return total, bad, time.monotonic() - waiting
        finally:
            # A failed read leaves hashes running over blocks about to be freed: let
            # them finish before the caller cancels the reservation.
            for _, check in pending:
                if not check.cancel():
                    check.exception()  # waits for it to finish

    def _read(self, read: ReadBlocks, src: list[int], dst: list[int]) -> ReadResult:
        result = read(src, dst)
        self.flips.after_read(self.kv_blocks, dst)
        return result

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
