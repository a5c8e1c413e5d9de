"""Chained prefix hashes: the key the prefix cache and the router share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.prefix_hash import (
    PREFIX_HASH_VERSION,
    hash_seed,
    prefix_block_hashes,
    short_prompt_key,
)

BS = 16
SEED = hash_seed("m")
TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=12 * 4)


def test_chain_changing_block0_changes_every_hash() -> None:
    tokens = list(range(100, 100 + 4 * BS))
    base = prefix_block_hashes(tokens, BS, SEED)
    assert len(base) == 4
    changed = list(tokens)
    changed[3] += 1  # a token in block 0
    other = prefix_block_hashes(changed, BS, SEED)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_chain_changing_block2_leaves_earlier_hashes() -> None:
    tokens = list(range(100, 100 + 4 * BS))
    base = prefix_block_hashes(tokens, BS, SEED)
    changed = list(tokens)
    changed[2 * BS + 5] = 0  # a token in block 2
    other = prefix_block_hashes(changed, BS, SEED)
    assert other[:2] == base[:2]
    assert other[2] != base[2]
    assert other[3] != base[3]


def test_same_block_content_at_different_positions_hashes_differently() -> None:
    # Block 1 repeats block 0's tokens; its hash still differs (it is chained).
    block = list(range(BS))
    hashes = prefix_block_hashes(block + block, BS, SEED)
    assert hashes[0] != hashes[1]


def test_only_full_blocks_are_hashed() -> None:
    assert prefix_block_hashes([], BS, SEED) == []
    assert prefix_block_hashes(list(range(BS - 1)), BS, SEED) == []
    one = prefix_block_hashes(list(range(BS)), BS, SEED)
    assert len(one) == 1
    # A trailing partial block adds no hash and changes none.
    assert prefix_block_hashes([*range(BS), 5, 6, 7], BS, SEED) == one
    assert len(prefix_block_hashes(list(range(3 * BS + BS - 1)), BS, SEED)) == 3


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        prefix_block_hashes([1, 2, 3], 0, SEED)
    with pytest.raises(ValueError):
        prefix_block_hashes([1, 2, 3], -4, SEED)


def test_block_size_is_part_of_the_key() -> None:
    tokens = list(range(64))
    assert prefix_block_hashes(tokens, 16, SEED)[0] != prefix_block_hashes(tokens, 32, SEED)[0]


@settings(max_examples=200, deadline=None)
@given(
    tokens=TOKENS,
    block_size=st.integers(min_value=1, max_value=8),
    start=st.integers(min_value=0, max_value=14),
)
def test_extension_equals_hashing_from_scratch(
    tokens: list[int], block_size: int, start: int
) -> None:
    full = prefix_block_hashes(tokens, block_size, SEED)
    assert len(full) == len(tokens) // block_size
    prev = full[start - 1] if 0 < start <= len(full) else None
    tail = prefix_block_hashes(tokens, block_size, SEED, start=start, prev_hash=prev)
    assert tail == full[start:]


@settings(max_examples=100, deadline=None)
@given(tokens=TOKENS, split=st.integers(min_value=0, max_value=12 * 4))
def test_extending_a_growing_sequence(tokens: list[int], split: int) -> None:
    """How the scheduler uses it: hash a prefix, then extend as tokens arrive."""
    head = prefix_block_hashes(tokens[:split], 4, SEED)
    more = prefix_block_hashes(
        tokens, 4, SEED, start=len(head), prev_hash=head[-1] if head else None
    )
    assert head + more == prefix_block_hashes(tokens, 4, SEED)


def test_tenant_salt_and_model_give_disjoint_hashes() -> None:
    tokens = list(range(8 * BS))
    seeds = [
        hash_seed("m"),
        hash_seed("m", "tenant-a"),
        hash_seed("m", "tenant-b"),
        hash_seed("m2"),
    ]
    assert len(set(seeds)) == 4
    chains = [set(prefix_block_hashes(tokens, BS, s)) for s in seeds]
    assert all(len(c) == 8 for c in chains)
    for i in range(len(chains)):
        for j in range(i + 1, len(chains)):
            assert not chains[i] & chains[j], (i, j)


def test_seed_fields_are_separated() -> None:
    # The NUL separator keeps ("ab", "c") and ("a", "bc") apart.
    assert hash_seed("ab", "c") != hash_seed("a", "bc")
    assert hash_seed("m", "") == hash_seed("m")


def test_max_blocks_caps_from_block_zero() -> None:
    tokens = list(range(6 * BS))
    full = prefix_block_hashes(tokens, BS, SEED)
    assert prefix_block_hashes(tokens, BS, SEED, max_blocks=2) == full[:2]
    assert prefix_block_hashes(tokens, BS, SEED, max_blocks=0) == []
    assert prefix_block_hashes(tokens, BS, SEED, max_blocks=100) == full
    capped = prefix_block_hashes(tokens, BS, SEED, max_blocks=4, start=2, prev_hash=full[1])
    assert capped == full[2:4]
    assert prefix_block_hashes(tokens, BS, SEED, max_blocks=2, start=2, prev_hash=full[1]) == []


def test_accepts_any_int_sequence_type() -> None:
    tokens = list(range(2 * BS))
    assert prefix_block_hashes(tuple(tokens), BS, SEED) == prefix_block_hashes(tokens, BS, SEED)
    assert prefix_block_hashes(range(2 * BS), BS, SEED) == prefix_block_hashes(tokens, BS, SEED)


# Pinned once from this implementation (PREFIX_HASH_VERSION 1). If the function changes
# on purpose, bump PREFIX_HASH_VERSION and re-pin: routers and caches must never mix.
PINNED_VERSION = 1
PINNED_SEED = 16525646959608763700
PINNED_HASHES = [8309329451419928575, 18258899499130294190]
PINNED_SHORT_KEY = 3248727683951516011


def test_pinned_values() -> None:
    assert PREFIX_HASH_VERSION == PINNED_VERSION
    assert hash_seed("m") == PINNED_SEED
    assert prefix_block_hashes(list(range(32)), 16, PINNED_SEED) == PINNED_HASHES
    assert short_prompt_key([1, 2, 3], PINNED_SEED) == PINNED_SHORT_KEY


def test_deterministic_across_calls_and_processes() -> None:
    tokens = list(range(32))
    assert prefix_block_hashes(tokens, 16, SEED) == prefix_block_hashes(tokens, 16, SEED)
    code = (
        "from engine.prefix_hash import hash_seed, prefix_block_hashes;"
        "print(prefix_block_hashes(list(range(32)), 16, hash_seed('m')))"
    )
    root = Path(__file__).resolve().parents[3]
    # A different PYTHONHASHSEED: the keys must not depend on Python's str hashing.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root
    )
    assert out.stdout.strip() == str(PINNED_HASHES)


def test_short_prompt_key() -> None:
    prompt = [5, 6, 7]
    a = short_prompt_key(prompt, hash_seed("m", "tenant-a"))
    b = short_prompt_key(prompt, hash_seed("m", "tenant-b"))
    assert a != b
    assert short_prompt_key(prompt, hash_seed("m", "tenant-a")) == a
    assert short_prompt_key([5, 6, 8], hash_seed("m", "tenant-a")) != a
    assert short_prompt_key([], SEED) != short_prompt_key([0], SEED)


def test_an_adapters_digest_gives_its_own_chain_and_the_base_keeps_its_seed() -> None:
    tokens = list(range(4 * BS))
    base = hash_seed("m", "t")
    assert hash_seed("m", "t", "") == base  # the base model's keys are what they were
    adapters = {hash_seed("m", "t", d) for d in ("a" * 32, "b" * 32)}
    assert len(adapters | {base}) == 3
    chains = [set(prefix_block_hashes(tokens, BS, s)) for s in adapters | {base}]
    assert not (chains[0] & chains[1]) and not (chains[1] & chains[2])
