"""The pool of KV-cache blocks: reference counts, the free queue and the prefix-cache map.

Lifecycle of a block id:
  free (uncached) --allocate--> in use (ref >= 1) --cache_full_block--> in use + hashed
  in use --free (ref hits 0)--> free: uncached blocks go to the uncached free list, hashed
  ones are parked with their tenant's share of the cache (engine/cache_share.py), where
  they stay reusable by `touch` on a prefix hit. allocate takes uncached blocks first,
  then evicts parked ones, the most over-share tenant's least recently freed first,
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

from engine.cache_share import NO_OWNER, CacheOwner, CacheShares
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
    """Reference-counted KV block ids with a prefix cache of freed, hashed blocks, evicted
    by tenant share and then least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tenant_of: list[str] = [""] * num_blocks  # meaningful while in use or parked
        self._by_hash: dict[int, int] = {}
        # Plain dicts keep insertion order; OrderedDict gives O(1) pop from the front.
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._shares = CacheShares()  # hashed blocks by tenant; the free ones parked
        #: Called with (block_id, hash) when a cached block is evicted for reuse.
        self.on_evict: Callable[[int, int], None] | None = None
        #: Told of every hash the pool starts or stops holding (the worker's index feed).
        self.residency: ResidencyLog | None = None

    # -- queries -----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + self._shares.num_parked

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
            cached_free=self._shares.num_parked,
        )

    # -- mutations ---------------------------------------------------------------
    def grow(
        self, block_ids: list[int], num_tokens: int, block_size: int,
        owner: CacheOwner = NO_OWNER, *, headroom: int | None = None,
    ) -> bool:  # fmt: skip
        """Extend a block table (in place) to cover `num_tokens`, for `owner`; False,
        allocating nothing, when the pool is short. With `headroom`, a guarded allocation
        (engine/cache_guard.py): only blocks its tenant may evict count (`allocate`), and
        `headroom` of them must be left over."""
        need = -(-num_tokens // block_size) - len(block_ids)
        if need <= 0:
            return True
        guarded = headroom is not None
        if need + (headroom or 0) > self.num_free_for(owner if guarded else None):
            return False
        block_ids.extend(self._take(need, owner, guarded))
        return True

    @property
    def num_tenants(self) -> int:
        """Tenants holding at least one block, in use or free and cached."""
        return self._shares.num_tenants

    def num_free_for(self, owner: CacheOwner | None) -> int:
        """Blocks a guarded allocation for `owner` could take (None: anyone's, `num_free`)."""
        if owner is None:
            return self.num_free
        return len(self._free_uncached) + self._shares.evictable(owner.tenant)

    def allocate(self, n: int, owner: CacheOwner = NO_OWNER, *, guarded: bool = False) -> list[int]:
        """Take `n` blocks with ref 1, held in `owner`'s share; raises OutOfBlocksError
        (and takes none) if short. Uncached blocks go first, then parked ones by tenant
        share (engine/cache_share.py); a `guarded` allocation evicts only its own
        tenant's and those of tenants holding at least as much per weight as its own."""
        available = self.num_free_for(owner if guarded else None)
        if n > available:
            raise OutOfBlocksError(f"need {n} KV blocks, {available} free")
        return self._take(n, owner, guarded)

    def _take(self, n: int, owner: CacheOwner, guarded: bool) -> list[int]:
        # The guard's floor is the owner's load before this allocation raises it.
        tenant, floor = (owner.tenant, self._shares.load(owner.tenant)) if guarded else (None, 0.0)
        out: list[int] = []
        for _ in range(n):
            if self._free_uncached:
                block_id, _ = self._free_uncached.popitem(last=False)
            else:
                block_id = self._shares.evict(tenant, floor)
                block_hash = self._hash_of[block_id]
                if self.on_evict is not None and block_hash is not None:
                    self.on_evict(block_id, block_hash)
                self._evict(block_id)
            self._ref[block_id] = 1
            self._tenant_of[block_id] = owner.tenant
            self._shares.hold(owner)
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                if self._hash_of[block_id] is None:
                    self._free_uncached.pop(block_id)  # an id no request held: unowned
                    self._tenant_of[block_id] = NO_OWNER.tenant
                    self._shares.hold(NO_OWNER)
                else:
                    self._shares.unpark(block_id, self._tenant_of[block_id])
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
                    self._shares.release(self._tenant_of[block_id])
                else:
                    self._shares.park(block_id, self._tenant_of[block_id])

    def cache_full_block(
        self, block_id: int, block_hash: int, owner: CacheOwner | None = None
    ) -> bool:
        """Publish a full block under its chained hash (moved to `owner`'s share when one
        is given and the block was allocated for another); False if another block has
        the hash.

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
        if owner is not None and owner.tenant != self._tenant_of[block_id]:
            self._shares.release(self._tenant_of[block_id])
            self._tenant_of[block_id] = owner.tenant
            self._shares.hold(owner)
        if self.residency is not None:
            self.residency.add(block_hash)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block's hash; returns how many were dropped."""
        dropped = 0
        for block_id in self._shares.drain():
            self._evict(block_id)
            self._free_uncached[block_id] = None
            dropped += 1
        return dropped

    def held_by(self, tenant: str) -> int:
        """Blocks `tenant` holds now: in use, or free and cached."""
        return self._shares.held(tenant)

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            self._shares.release(self._tenant_of[block_id])
            if self._by_hash.get(block_hash) == block_id:
                del self._by_hash[block_hash]
                if self.residency is not None:
                    self.residency.remove(block_hash)
