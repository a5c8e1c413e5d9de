"""Chained prefix hashes over full KV blocks: the one function the engine's prefix cache
and the router's placement key share, so that a routing hit is a cache hit.

Lifecycle: a caller derives a seed once per (model, tenant) with `hash_seed`, then calls
`prefix_block_hashes` on a token sequence. Hash i covers tokens [0, (i + 1) * block_size)
because each block's hash is seeded with the previous block's hash:
`h_i = XXH3-64(tokens of block i, seed=h_{i-1})`, `h_{-1} = seed`. Only full blocks are
hashed; a trailing partial block never gets a hash (its KV is still being written).
Tenants never share keys: the tenant salt is folded into the seed, and so is a LoRA
adapter's digest (requests of one adapter share blocks, never with another adapter's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

#: Bumped whenever the hash function changes, so old caches and routers never match.
PREFIX_HASH_VERSION = 1


def hash_seed(model_fingerprint: str, tenant_salt: str = "", adapter_digest: str = "") -> int:
    """Seed for a (model, tenant, LoRA adapter) triple: different models, tenants or
    adapters never share hashes (the base model's seed has no adapter part)."""
    material = f"pdserve-prefix-v{PREFIX_HASH_VERSION}\0{model_fingerprint}\0{tenant_salt}"
    if adapter_digest:
        material += f"\0lora:{adapter_digest}"
    return xxhash.xxh3_64_intdigest(material.encode())


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int,
    *,
    max_blocks: int | None = None,
    start: int = 0,
    prev_hash: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`.

    `start`/`prev_hash` let a caller extend an existing chain: hash blocks from block index
    `start` on, seeded with the chain's last hash (`prev_hash`, or `seed` when start is 0).
    `max_blocks` caps how many blocks (counted from block 0) are hashed, for routing keys.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    if start >= n_full:
        return []
    if start > 0 and prev_hash is None:
        raise ValueError("extending a chain (start > 0) needs the chain's prev_hash")
    # uint32 covers every vocabulary in use and makes one contiguous buffer to slice.
    tokens = np.asarray(token_ids[start * block_size : n_full * block_size], dtype=np.uint32)
    data = tokens.tobytes()
    stride = block_size * 4
    h = seed if prev_hash is None else prev_hash
    hashes: list[int] = []
    for i in range(n_full - start):
        h = xxhash.xxh3_64_intdigest(data[i * stride : (i + 1) * stride], seed=h)
        hashes.append(h)
    return hashes


def short_prompt_key(token_ids: Sequence[int], seed: int) -> int:
    """Key for a prompt shorter than one block: a hash of whatever tokens there are."""
    data = np.asarray(token_ids, dtype=np.uint32).tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=seed)
