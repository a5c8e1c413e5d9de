"""Block checksums and the bit-flip fault hook, on a bare pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.checksum import block_checksums, mismatched
from kvtransfer.fault import ENV, BitFlips

BLOCKS, BYTES = 6, 4096


def _pool(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8, generator=generator)


@settings(max_examples=200, deadline=None)
@given(block=st.integers(0, BLOCKS - 1), byte=st.integers(0, BYTES - 1), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_found_in_its_block_only(block: int, byte: int, bit: int) -> None:
    pool = _pool()
    ids = [4, 0, 5, 2]
    expected = block_checksums(pool, ids)
    pool[block, byte] ^= 1 << bit
    assert mismatched(pool, ids, expected) == ([ids.index(block)] if block in ids else [])


def test_checksums_follow_the_bytes_not_the_block_id() -> None:
    pool = _pool()
    pool[3] = pool[1]
    assert block_checksums(pool, [1])[0] == block_checksums(pool, [3])[0]
    assert len(set(block_checksums(pool, range(BLOCKS)))) == BLOCKS - 1


def test_a_checksum_count_that_does_not_match_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 blocks but 2 checksums"):
        mismatched(_pool(), [0, 1, 2], [1, 2])


def test_flips_hit_every_nth_read_once_and_by_one_bit() -> None:
    flips = BitFlips(every=3, seed=4)
    pool = _pool()
    for read in range(1, 10):
        before = pool.clone()
        hit = flips.after_read(pool, [2, 5])
        changed = (before != pool).nonzero().tolist()
        if read % 3:
            assert hit is None and changed == []
            continue
        assert hit is not None and len(changed) == 1
        row, col = changed[0]
        assert row == [2, 5][hit]
        assert bin(int(before[row, col]) ^ int(pool[row, col])).count("1") == 1
    assert (flips.reads, flips.flipped) == (9, 3)


def test_flips_are_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    pool = _pool()
    assert BitFlips.from_env().after_read(pool, [0, 1]) is None
    assert torch.equal(pool, _pool())
    monkeypatch.setenv(ENV, "2")
    assert BitFlips.from_env().every == 2
    monkeypatch.setenv(ENV, "often")
    with pytest.raises(ValueError, match=f"{ENV}: expected a whole number, got 'often'"):
        BitFlips.from_env()
