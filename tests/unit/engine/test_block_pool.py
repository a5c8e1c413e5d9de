"""BlockPool: reference counts, the two free lists, LRU eviction and the prefix-cache map.

Every test ends with a leak check: after the test's references are dropped, no block is
in use and every block is on a free list.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.block_pool import BlockPool, BlockPoolStats
from engine.cache_share import CacheOwner
from engine.errors import OutOfBlocksError


def assert_no_leaks(pool: BlockPool) -> None:
    s = pool.stats()
    assert s.used == 0, s
    assert s.free == s.total == pool.num_blocks, s
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def test_rejects_non_positive_size() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(-3)


def test_fresh_pool_stats() -> None:
    pool = BlockPool(8)
    assert pool.stats() == BlockPoolStats(total=8, free=8, used=0, cached=0, cached_free=0)
    assert_no_leaks(pool)


def test_allocate_gives_distinct_blocks_with_ref_one() -> None:
    pool = BlockPool(6)
    a = pool.allocate(4)
    assert len(a) == len(set(a)) == 4
    assert all(pool.ref_count(b) == 1 for b in a)
    s = pool.stats()
    assert (s.free, s.used) == (2, 4)
    assert s.free + s.used == s.total
    assert pool.allocate(0) == []
    pool.free(a)
    assert_no_leaks(pool)


def test_allocate_takes_uncached_before_evicting_cached() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.cache_full_block(a, 111)
    assert pool.cache_full_block(b, 222)
    pool.free([a, b, c, d])
    assert pool.stats().cached_free == 2
    # Two uncached blocks are free: they go first and no hash is dropped.
    first = pool.allocate(2)
    assert sorted(first) == sorted([c, d])
    assert pool.lookup(111) == a and pool.lookup(222) == b
    assert pool.stats().cached == 2
    # Now only cached blocks are left; taking one evicts it.
    second = pool.allocate(1)
    assert second == [a]
    assert pool.lookup(111) is None
    assert pool.block_hash(a) is None
    assert pool.lookup(222) == b
    pool.free(first + second)
    assert_no_leaks(pool)


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        assert pool.cache_full_block(blk, 1000 + i)
    # Free in the order 2, 0, 1: that is the eviction order.
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    assert pool.allocate(1) == [blocks[2]]
    assert pool.lookup(1002) is None
    assert pool.lookup(1000) == blocks[0] and pool.lookup(1001) == blocks[1]
    assert pool.allocate(1) == [blocks[0]]
    assert pool.lookup(1000) is None
    assert pool.allocate(1) == [blocks[1]]
    assert pool.stats().cached == 0
    pool.free(blocks)
    assert_no_leaks(pool)


def test_free_order_within_one_call_sets_lru_order() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    pool.cache_full_block(x, 1)
    pool.cache_full_block(y, 2)
    pool.free([y, x])  # tail first, as the scheduler does: y is evicted before x
    assert pool.allocate(1) == [y]
    assert pool.lookup(1) == x and pool.lookup(2) is None
    pool.free([y])
    assert_no_leaks(pool)


def test_touch_on_free_cached_block_takes_it_off_free_list() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_full_block(a, 42)
    pool.free([a, b, c])
    assert pool.stats() == BlockPoolStats(total=3, free=3, used=0, cached=1, cached_free=1)
    hit = pool.lookup(42)
    assert hit == a
    pool.touch([hit])
    assert pool.ref_count(a) == 1
    s = pool.stats()
    assert (s.free, s.used, s.cached, s.cached_free) == (2, 1, 1, 0)
    # The touched block is no longer a candidate for allocation or eviction.
    others = pool.allocate(2)
    assert a not in others
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.lookup(42) == a
    pool.free(others)
    pool.free([a])
    # Freed again, it goes back to the cached free list with its hash.
    assert pool.stats().cached_free == 1 and pool.lookup(42) == a
    assert_no_leaks(pool)


def test_touch_on_in_use_block_shares_it() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, 7)
    pool.touch([a, a])
    assert pool.ref_count(a) == 3
    pool.free([a])
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.stats().used == 1
    pool.free([a])
    assert pool.ref_count(a) == 0
    assert_no_leaks(pool)


def test_free_below_zero_raises() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    assert pool.ref_count(a) == 0
    with pytest.raises(RuntimeError):
        pool.free([1 - a])  # never allocated
    # The failed frees did not put anything on a free list twice.
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == [0, 1]
    pool.free([0, 1])
    assert_no_leaks(pool)


def test_cache_full_block_duplicate_hash() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    assert pool.cache_full_block(a, 5) is True
    # Another block cannot take a hash that is already published.
    assert pool.cache_full_block(b, 5) is False
    assert pool.block_hash(b) is None
    assert pool.lookup(5) == a
    # Re-publishing the same block under the same hash is fine; a different hash is not.
    assert pool.cache_full_block(a, 5) is True
    assert pool.cache_full_block(a, 6) is False
    assert pool.block_hash(a) == 5 and pool.lookup(6) is None
    assert pool.stats().cached == 1
    # Once a's hash is evicted, b may publish it.
    pool.free([a, b, c])
    taken = pool.allocate(3)  # evicts a (the only cached free block) last
    assert pool.lookup(5) is None
    assert pool.cache_full_block(taken[0], 5) is True
    assert pool.lookup(5) == taken[0]
    pool.free(taken)
    assert_no_leaks(pool)


def test_lookup_after_eviction_returns_none() -> None:
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, 99)
    pool.free([a])
    assert pool.lookup(99) == a
    (again,) = pool.allocate(1)
    assert again == a
    assert pool.lookup(99) is None
    assert pool.block_hash(a) is None
    assert pool.stats().cached == 0
    pool.free([a])
    # Freed without a hash it goes to the uncached list.
    assert pool.stats().cached_free == 0
    assert_no_leaks(pool)


def test_reset_prefix_cache_drops_only_free_cached_blocks() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for blk, h in ((a, 1), (b, 2), (c, 3)):
        pool.cache_full_block(blk, h)
    pool.free([a, b, d])  # c stays in use, hashed
    assert pool.stats().cached_free == 2
    assert pool.reset_prefix_cache() == 2
    s = pool.stats()
    assert (s.cached, s.cached_free, s.free, s.used) == (1, 0, 3, 1)
    assert pool.lookup(1) is None and pool.lookup(2) is None
    assert pool.lookup(3) == c
    assert pool.block_hash(a) is None and pool.block_hash(b) is None
    assert pool.reset_prefix_cache() == 0
    pool.free([c])
    assert pool.stats().cached_free == 1
    assert_no_leaks(pool)


def test_out_of_blocks_takes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(1)
    (cached,) = pool.allocate(1)
    pool.cache_full_block(cached, 8)
    pool.free([cached])
    before = pool.stats()
    refs = [pool.ref_count(b) for b in range(4)]
    with pytest.raises(OutOfBlocksError, match="need 4"):
        pool.allocate(4)
    assert pool.stats() == before
    assert [pool.ref_count(b) for b in range(4)] == refs
    assert pool.lookup(8) == cached  # nothing evicted by the failed call
    # Exactly the free count still succeeds.
    rest = pool.allocate(3)
    assert pool.stats().free == 0
    pool.free(rest + held)
    assert_no_leaks(pool)


def test_out_of_blocks_error_is_a_memory_error() -> None:
    pool = BlockPool(1)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert_no_leaks(pool)


# -- stateful ------------------------------------------------------------------------

NUM_BLOCKS = 6
HASH_VALUES = range(8)  # few hashes, so duplicates happen
HASHES = st.sampled_from(HASH_VALUES)
#: Two tenants' weights, chosen so that no two tenants with a free cached block can tie
#: on blocks per weight within NUM_BLOCKS (the machine checks an exact eviction order).
TENANTS = {"even": 1.0, "odd": 2.5}


def _hash_owner(block_hash: int) -> CacheOwner:
    """Tenants never share a hash: even hashes are one tenant's, odd ones the other's."""
    tenant = "even" if block_hash % 2 == 0 else "odd"
    return CacheOwner(tenant, TENANTS[tenant])


def _owner(block_id: int, pool: BlockPool) -> CacheOwner:
    block_hash = pool.block_hash(block_id)
    assert block_hash is not None
    return _hash_owner(block_hash)


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives allocate/free/touch/cache/reset; `held` is the multiset of refs we own."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.held: list[int] = []
        self.clock = 0
        self.freed_at: dict[int, int] = {}

    @initialize()
    def start_empty(self) -> None:
        assert self.pool.stats().used == 0

    # -- helpers -----------------------------------------------------------------
    def _drop(self, block_id: int) -> None:
        self.held.remove(block_id)
        self.pool.free([block_id])
        if self.pool.ref_count(block_id) == 0:
            self.clock += 1
            self.freed_at[block_id] = self.clock

    def _expected_evictions(self, n: int) -> list[int]:
        """The cached free blocks `allocate` must evict for `n` blocks, in order."""
        parked = {t: sorted((b for b in self._free_cached() if _owner(b, self.pool).tenant == t),
                            key=lambda b: self.freed_at[b]) for t in TENANTS}  # fmt: skip
        held = {t: self.pool.held_by(t) for t in TENANTS}
        out = []
        for _ in range(n):
            tenant = max((t for t in TENANTS if parked[t]), key=lambda t: held[t] / TENANTS[t])
            out.append(parked[tenant].pop(0))
            held[tenant] -= 1
        return out

    def _free_cached(self) -> list[int]:
        return [
            b
            for b in range(NUM_BLOCKS)
            if self.pool.ref_count(b) == 0 and self.pool.block_hash(b) is not None
        ]

    # -- rules -------------------------------------------------------------------
    @rule(n=st.integers(min_value=0, max_value=NUM_BLOCKS + 2))
    def allocate(self, n: int) -> None:
        before = self.pool.stats()
        if n > before.free:
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(n)
            assert self.pool.stats() == before
            return
        free_uncached = {
            b
            for b in range(NUM_BLOCKS)
            if self.pool.ref_count(b) == 0 and self.pool.block_hash(b) is None
        }
        evictions = self._expected_evictions(n - min(n, len(free_uncached)))
        got = self.pool.allocate(n)
        assert len(got) == len(set(got)) == n
        assert all(self.pool.ref_count(b) == 1 for b in got)
        assert not set(got) & set(self.held)
        # Uncached first; then cached ones, the most over-share tenant's least recently
        # freed first.
        n_unc = min(n, len(free_uncached))
        assert set(got[:n_unc]) <= free_uncached
        assert got[n_unc:] == evictions
        assert all(self.pool.block_hash(b) is None for b in got[n_unc:])
        self.held.extend(got)

    @rule(data=st.data())
    def finished_sequence(self, data: st.DataObject) -> None:
        """A sequence's life: allocate, publish its blocks, free them tail first."""
        n = data.draw(st.integers(min_value=1, max_value=3))
        if n > self.pool.num_free:
            return
        got = self.pool.allocate(n)
        self.held.extend(got)
        for block_id in got:
            self._publish(block_id, data.draw(HASHES))
        for block_id in reversed(got):
            self._drop(block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.held))
        ref = self.pool.ref_count(block_id)
        self._drop(block_id)
        assert self.pool.ref_count(block_id) == ref - 1

    @rule(block_id=st.integers(min_value=0, max_value=NUM_BLOCKS - 1))
    def free_unowned_raises(self, block_id: int) -> None:
        if block_id in self.held:
            return
        before = self.pool.stats()
        with pytest.raises(RuntimeError):
            self.pool.free([block_id])
        assert self.pool.stats() == before
        assert self.pool.ref_count(block_id) == 0

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def touch_in_use(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.held))
        ref = self.pool.ref_count(block_id)
        used = self.pool.stats().used
        self.pool.touch([block_id])
        assert self.pool.ref_count(block_id) == ref + 1
        assert self.pool.stats().used == used
        self.held.append(block_id)

    @rule(block_hash=HASHES)
    def touch_cache_hit(self, block_hash: int) -> None:
        block_id = self.pool.lookup(block_hash)
        if block_id is None:
            return
        assert self.pool.block_hash(block_id) == block_hash
        ref = self.pool.ref_count(block_id)
        before = self.pool.stats()
        self.pool.touch([block_id])
        assert self.pool.ref_count(block_id) == ref + 1
        after = self.pool.stats()
        if ref == 0:
            assert after.free == before.free - 1
            assert after.cached_free == before.cached_free - 1
        else:
            assert after == before
        self.held.append(block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=HASHES)
    def cache(self, data: st.DataObject, block_hash: int) -> None:
        self._publish(data.draw(st.sampled_from(self.held)), block_hash)

    def _publish(self, block_id: int, block_hash: int) -> None:
        old = self.pool.block_hash(block_id)
        owner = self.pool.lookup(block_hash)
        ok = self.pool.cache_full_block(block_id, block_hash, _hash_owner(block_hash))
        if old is not None:
            assert ok == (old == block_hash)
            assert self.pool.block_hash(block_id) == old
        elif owner is not None:
            assert ok is False
            assert self.pool.block_hash(block_id) is None
            assert self.pool.lookup(block_hash) == owner
        else:
            assert ok is True
            assert self.pool.lookup(block_hash) == block_id

    @rule()
    def reset_prefix_cache(self) -> None:
        cached_free = self.pool.stats().cached_free
        in_use_hashed = {b: h for b in set(self.held) if (h := self.pool.block_hash(b)) is not None}
        assert self.pool.reset_prefix_cache() == cached_free
        s = self.pool.stats()
        assert s.cached_free == 0
        for b, h in in_use_hashed.items():
            assert self.pool.lookup(h) == b

    # -- invariants --------------------------------------------------------------
    @invariant()
    def refcounts_match_what_we_hold(self) -> None:
        for b in range(NUM_BLOCKS):
            ref = self.pool.ref_count(b)
            assert ref >= 0
            assert ref == self.held.count(b)

    @invariant()
    def each_block_free_once_or_in_use(self) -> None:
        uncached = self.pool._free_uncached
        cached = self.pool._shares.parked()
        assert len(cached) == len(set(cached))
        for b in range(NUM_BLOCKS):
            on_lists = (b in uncached) + (b in cached)
            if self.pool.ref_count(b) > 0:
                assert on_lists == 0, b
            else:
                assert on_lists == 1, b
                # The list matches the block's hash state.
                assert (b in cached) == (self.pool.block_hash(b) is not None), b

    @invariant()
    def stats_consistent(self) -> None:
        s = self.pool.stats()
        assert s.total == NUM_BLOCKS
        assert s.free + s.used == s.total
        assert s.free == self.pool.num_free
        assert s.used == sum(1 for b in range(NUM_BLOCKS) if self.pool.ref_count(b) > 0)
        assert s.cached == sum(1 for b in range(NUM_BLOCKS) if self.pool.block_hash(b) is not None)
        assert s.cached_free == len(self._free_cached())
        for tenant in TENANTS:
            hashed = [b for b in range(NUM_BLOCKS) if self.pool.block_hash(b) is not None]
            assert self.pool.held_by(tenant) == sum(
                1 for b in hashed if _owner(b, self.pool).tenant == tenant
            )

    @invariant()
    def hashes_point_back(self) -> None:
        for h in HASH_VALUES:
            owner = self.pool.lookup(h)
            if owner is not None:
                assert self.pool.block_hash(owner) == h
        hashed = [self.pool.block_hash(b) for b in range(NUM_BLOCKS)]
        present = [h for h in hashed if h is not None]
        assert len(present) == len(set(present))  # no hash on two blocks
        for b, bh in enumerate(hashed):
            if bh is not None:
                assert self.pool.lookup(bh) == b

    def teardown(self) -> None:
        for block_id in list(self.held):
            self._drop(block_id)
        assert not self.held
        assert_no_leaks(self.pool)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=75, stateful_step_count=30, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
