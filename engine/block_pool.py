"""The pool of KV-cache blocks: reference counts, the free queue and the prefix-cache map.

Lifecycle of a block id:
  free (uncached) --allocate--> in use (ref >= 1) --cache_full_block--> in use + hashed
  in use --free (ref hits 0)--> free: uncached blocks go to the uncached free list, hashed
  blocks to the LRU cached free list, where they stay reusable by `touch` on a prefix hit.
  allocate takes uncached blocks first and evicts cached ones least recently used first,
  dropping their hash, so cached KV is the last thing given up. With an offload tier,
  `on_evict(block_id, hash)` runs before an evicted block is handed out again, so the
  tier can copy its bytes away (engine/kv_offload.py). With a residency log, every hash
  published or dropped is reported to it (engine/residency.py), for the router's index.

The pool never touches KV memory; it only hands out ids. It is not thread-safe: the engine
owns it and calls it from its step thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.errors import OutOfBlocksError
from engine.residency import ResidencyLog


@dataclass(frozen=True)
class BlockPoolStats:
    """A snapshot of the pool. `cached` counts hashed blocks, in use or free."""

    total: int
    free: int
    used: int
    cached: int
    cached_free: int


class BlockPool:
    """Reference-counted KV block ids with an LRU prefix cache of freed, hashed blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Plain dicts keep insertion order; OrderedDict gives O(1) pop from the front.
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        #: Called with (block_id, hash) when a cached block is evicted for reuse.
        self.on_evict: Callable[[int, int], None] | None = None
        #: Told of every hash the pool starts or stops holding (the worker's index feed).
        self.residency: ResidencyLog | None = None

    # -- queries -----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the KV for this chained hash, if cached."""
        return self._by_hash.get(block_hash)

    def cached_hashes(self) -> frozenset[int]:
        """Every hash the pool holds now, in use or free (O(cached): for checks)."""
        return frozenset(self._by_hash)

    def longest_cached_prefix(self, block_hashes: list[int]) -> list[int]:
        """Blocks of the longest run of leading hashes that are cached (takes no refs)."""
        hits: list[int] = []
        for block_hash in block_hashes:
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def stats(self) -> BlockPoolStats:
        free = self.num_free
        return BlockPoolStats(
            total=self.num_blocks,
            free=free,
            used=self.num_blocks - free,
            cached=len(self._by_hash),
            cached_free=len(self._free_cached),
        )

    # -- mutations ---------------------------------------------------------------
    def grow(self, block_ids: list[int], num_tokens: int, block_size: int) -> bool:
        """Extend a block table (in place) to cover `num_tokens`; False, allocating
        nothing, when the pool is short."""
        need = -(-num_tokens // block_size) - len(block_ids)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        block_ids.extend(self.allocate(need))
        return True

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks with ref 1; raises OutOfBlocksError (and takes none) if short."""
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free} free")
        out: list[int] = []
        for _ in range(n):
            if self._free_uncached:
                block_id, _ = self._free_uncached.popitem(last=False)
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block_hash = self._hash_of[block_id]
                if self.on_evict is not None and block_hash is not None:
                    self.on_evict(block_id, block_hash)
                self._evict(block_id)
            self._ref[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                self._free_cached.pop(block_id, None)
                self._free_uncached.pop(block_id, None)
            self._ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block.

        Callers pass a sequence's blocks tail first, so that when the cache must evict,
        the tail of a prefix goes before its head (the head is shared more often).
        """
        for block_id in block_ids:
            ref = self._ref[block_id]
            if ref <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self._ref[block_id] = ref - 1
            if ref == 1:
                if self._hash_of[block_id] is None:
                    self._free_uncached[block_id] = None
                else:
                    self._free_cached[block_id] = None

    def cache_full_block(self, block_id: int, block_hash: int) -> bool:
        """Publish a full block under its chained hash; False if another block has it.

        Only a block in use may be published: a free one could be handed out again with
        its hash still pointing at it.
        """
        if self._ref[block_id] <= 0:
            raise RuntimeError(f"cannot publish free KV block {block_id}")
        if self._hash_of[block_id] is not None:
            return self._hash_of[block_id] == block_hash
        if block_hash in self._by_hash:
            return False
        self._hash_of[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        if self.residency is not None:
            self.residency.add(block_hash)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block's hash; returns how many were dropped."""
        dropped = list(self._free_cached)
        for block_id in dropped:
            self._evict(block_id)
            self._free_uncached[block_id] = None
        self._free_cached.clear()
        return len(dropped)

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            if self._by_hash.get(block_hash) == block_id:
                del self._by_hash[block_hash]
                if self.residency is not None:
                    self.residency.remove(block_hash)
