"""ReadChecker: chunked reads checked against checksums, a re-read, and what it counts.
The read is a copy between two in-process pools (the backends have their own tests)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtransfer import checked_read
from kvtransfer.backend import ReadResult
from kvtransfer.checked_read import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, ReadChecker, chunk_bounds
from kvtransfer.checksum import block_checksums, mismatched
from kvtransfer.errors import KvCorruptionError
from kvtransfer.fault import BitFlips

BLOCK_BYTES = 1 << 20
BLOCKS = 40


@given(
    num_blocks=st.integers(1, 3000),
    block_bytes=st.sampled_from([1 << 12, 368_640, 737_280, 1 << 27]),
)
def test_chunks_cover_every_block_once_and_shrink(num_blocks: int, block_bytes: int) -> None:
    bounds = chunk_bounds(num_blocks, block_bytes)
    assert bounds[0][0] == 0 and bounds[-1][1] == num_blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [end - start for start, end in bounds]
    top = max(1, MAX_CHUNK_BYTES // block_bytes, MIN_CHUNK_BYTES // block_bytes)
    assert all(1 <= s <= top for s in sizes)
    assert sizes == sorted(sizes, reverse=True)  # the last hashes, exposed, are the least


class Copier:
    """The exporter's pool and a read that copies from it, counting calls."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.source = torch.randint(0, 256, pool.shape, dtype=torch.uint8)
        self.pool = pool
        self.calls: list[int] = []

    def __call__(self, src: list[int], dst: list[int]) -> ReadResult:
        self.pool[dst] = self.source[src]
        self.calls.append(len(src))
        return ReadResult(len(src) * self.pool.shape[1], len(src), 0.001)


@pytest.fixture
def pool() -> torch.Tensor:
    return torch.zeros(BLOCKS * 2, BLOCK_BYTES, dtype=torch.uint8)


def _ids() -> tuple[list[int], list[int]]:
    return list(range(BLOCKS)), list(range(BLOCKS * 2 - 1, BLOCKS - 1, -1))


def test_a_clean_read_is_chunked_summed_and_matches(pool: torch.Tensor) -> None:
    read, (src, dst) = Copier(pool), _ids()
    checker = ReadChecker(pool, BitFlips())
    try:
        got = checker.read(read, src, dst, block_checksums(read.source, src))
    finally:
        checker.close()
    assert len(read.calls) > 1 and sum(read.calls) == BLOCKS  # overlapped, no re-read
    assert (got.mismatches, got.result.bytes, got.result.descriptors) == (
        0, BLOCKS * BLOCK_BYTES, BLOCKS,
    )  # fmt: skip
    assert torch.equal(pool[dst], read.source[src]) and got.verify_seconds >= 0


def test_a_flip_is_re_read_once_and_repaired(pool: torch.Tensor) -> None:
    read, (src, dst) = Copier(pool), _ids()
    flips = BitFlips(every=1000, seed=3)
    flips.reads = 999  # the first read call is hit, no later one
    checker = ReadChecker(pool, flips)
    try:
        got = checker.read(read, src, dst, block_checksums(read.source, src))
    finally:
        checker.close()
    assert flips.flipped == 1 and got.mismatches == 1 and read.calls[-1] == 1
    assert torch.equal(pool[dst], read.source[src])


def test_kv_that_differs_again_is_corrupt(pool: torch.Tensor) -> None:
    read, (src, dst) = Copier(pool), _ids()
    sums = block_checksums(read.source, src)
    sums[7] ^= 1  # the exporter's bytes and its checksum disagree: no re-read can help
    checker = ReadChecker(pool, BitFlips())
    try:
        with pytest.raises(KvCorruptionError, match=r"1 of 40 blocks .* exporter block 7"):
            checker.read(read, src, dst, sums)
    finally:
        checker.close()
    assert read.calls[-1] == 1


def test_a_failed_read_waits_for_the_hashes_it_started(
    pool: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller frees the blocks next: no hash may still be reading them."""
    copy, (src, dst) = Copier(pool), _ids()
    finished: list[int] = []

    def slow_mismatched(kv: torch.Tensor, ids: list[int], sums: list[int]) -> list[int]:
        time.sleep(0.2)
        finished.append(len(ids))
        return mismatched(kv, ids, sums)

    monkeypatch.setattr(checked_read, "mismatched", slow_mismatched)

    def read(s: list[int], d: list[int]) -> ReadResult:
        if copy.calls:
            raise TimeoutError("the second chunk never came")
        return copy(s, d)

    checker = ReadChecker(pool, BitFlips())
    try:
        with pytest.raises(TimeoutError):
            checker.read(read, src, dst, block_checksums(copy.source, src))
        assert finished == [copy.calls[0]]  # the first chunk's hash ended before the raise
    finally:
        checker.close()
