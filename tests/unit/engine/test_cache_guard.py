"""The cache guard in the scheduler (engine/cache_guard.py): which allocations a tenant's
share holds back, and that holding one tenant back never stalls another. Model-free
(tests/unit/engine/scheduler_sim.py), every run ending with the exact block accounting
and a leak check."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.cache_guard import CacheGuard
from engine.cache_share import CacheOwner
from engine.errors import OutOfBlocksError
from engine.kv_offload import OffloadTier
from engine.prefix_hash import hash_seed
from engine.request import Request, RequestStatus
from tests.unit.engine.scheduler_sim import make_req, make_sim, token_for
from tests.unit.engine.tiny_kv import tiny_kv_cache

A, B = CacheOwner("a"), CacheOwner("b")


def test_a_tenant_held_back_by_its_share_does_not_hold_up_another_tenant() -> None:
    # 12 blocks of 4 tokens: B's finished prompt leaves 2 parked; A streams (a1, 3
    # blocks), then asks for 28 prompt tokens (w: 7 blocks, and a1's next one) with 7
    # free uncached. w may not take the lighter B's parked blocks while a1 runs, so it
    # waits; B's request behind it in the queue goes first.
    sim = make_sim(num_blocks=12, block_size=4)
    b0 = make_req("b0", range(1000, 1008), 1, seed=hash_seed("m", "b"), owner=B)
    sim.add(b0)
    sim.run()
    assert sim.pool.held_by("b") == 2
    a1 = make_req("a1", range(8), 30, owner=A)
    sim.add(a1)
    sim.step()
    w = make_req("w", range(100, 128), 2, owner=A)
    b1 = make_req("b1", range(2000, 2004), 2, seed=hash_seed("m", "b"), owner=B)
    sim.add(w, b1)  # w first: the same class, so b1 waits behind it in the queue
    sim.step()
    assert w.status is RequestStatus.WAITING and b1.status is RequestStatus.RUNNING
    assert sim.pool.held_by("b") == 2 + 1  # its parked prefix and b1's block
    sim.run()
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a1, w, b1))
    sim.assert_no_leaks()


def test_an_import_leaves_room_for_the_output_it_carries() -> None:
    # A migrated stream arrives with 8 output tokens beyond its 8-token prompt: after the
    # commit it computes their KV, 2 more blocks. While its tenant has a1 running, the
    # reservation must leave them (and a1's next block) among the blocks A may take.
    sim = make_sim(num_blocks=9, block_size=4)
    b0 = make_req("b0", range(1000, 1008), 1, seed=hash_seed("m", "b"), owner=B)
    sim.add(b0)
    sim.run()  # B: 2 blocks parked
    a1 = make_req("a1", range(16), 10, owner=A)
    sim.add(a1)
    sim.step()  # a1: 4 blocks; 3 free uncached
    migrated = make_req("m", range(200, 208), 20, owner=A)
    migrated.output_token_ids.extend(token_for(migrated, i) for i in range(8))
    with pytest.raises(OutOfBlocksError):
        sim.sched.reserve_import(migrated)  # 2 + 2 + 1 > 3; the lighter B's 2 are not A's
    assert not migrated.block_ids and sim.pool.held_by("b") == 2
    sim.run()
    sim.assert_no_leaks()


def _guard(num_blocks: int) -> tuple[BlockPool, CacheGuard, list[Request]]:
    pool = BlockPool(num_blocks)
    running: list[Request] = []
    return pool, CacheGuard(pool, 4, running, {}, {}), running


def _running(rid: str, owner: CacheOwner, prompt: int, computed: int, pool: BlockPool) -> Request:
    req = make_req(rid, range(prompt), 4, owner=owner)
    req.block_ids = pool.allocate(-(-computed // 4), owner)
    req.num_computed_tokens = computed
    return req


def test_a_pool_short_for_everyone_is_not_the_guards_business() -> None:
    pool, guard, running = _guard(8)
    a1, a2 = _running("a1", A, 24, 8, pool), _running("a2", A, 4, 4, pool)
    b1 = _running("b1", B, 16, 16, pool)
    running += [a1, a2, b1]  # 2 + 1 + 4 blocks of 8: 1 free
    assert guard.guards_growth(a1, 12)  # 1 block: a free one would do, so A's share rules
    assert guard.gives_way(a1, guarded=True) == [0, 1]  # only A's requests give way
    # 2 blocks: short for everyone. Preempting by class (b1 may go) decides, and what
    # that frees may be taken whoever's it was: else b1 would go for nothing.
    assert not guard.guards_growth(a1, 16)
    assert guard.gives_way(a1, guarded=False) == [0, 1, 2]
    # A decode's next block, and a tenant's only running request, are never held.
    assert not guard.guards_growth(a2, 5)
    running.remove(a2)
    assert guard.guards_growth(a1, 12) is False
    assert guard.growth_room(a1) is None


def test_a_share_held_prompt_chunk_does_not_stop_other_tenants_of_its_class() -> None:
    # Chunked flood prompts next to another tenant's long prompt: whenever a flood
    # request gives way to its tenant's share, the other tenant's prefill still runs
    # in that step (the class is not dry), and nothing of the other tenant is preempted.
    sim = make_sim(num_blocks=24, block_size=16, budget=48)
    hot = make_req("hot", range(5000, 5064), 2, seed=hash_seed("m", "hot"),
                   owner=CacheOwner("hot"))  # fmt: skip
    sim.add(hot)
    sim.run()
    other = make_req("other", range(9000, 9160), 2, seed=hash_seed("m", "other"),
                     owner=CacheOwner("other"))  # fmt: skip
    floods = [make_req(f"f{i}", [7000 + 100 * i + t % 97 for t in range(160)], 2,
                       seed=hash_seed("m", "flood"), owner=CacheOwner("flood"))
              for i in range(4)]  # fmt: skip
    sim.add(*floods, other)
    held_back_steps = 0
    while sim.sched.has_work():
        batch = sim.step()
        if any(r.cache_owner.tenant == "flood" for r in batch.preempted):
            held_back_steps += 1
            assert other not in batch.preempted
            if other.status is RequestStatus.RUNNING and other.num_computed_tokens < 160:
                assert other in [r for r, _ in batch.items]
    assert held_back_steps > 0 and other.num_preemptions == 0
    sim.assert_no_leaks()


@pytest.mark.parametrize("guarded", [True, False])
def test_a_restore_from_the_tier_is_held_to_the_share_its_admission_is(guarded: bool) -> None:
    # The lighter tenant B has 2 blocks parked; A holds 4 in use and 2 blocks are free
    # uncached. Restoring A's 3 blocks from the tier, guarded, stops when only B's are
    # left; unguarded (one tenant, or A with nothing in flight) it takes one of B's.
    pool, cache = BlockPool(8), tiny_kv_cache(8, num_layers=1)
    tier = OffloadTier(cache, 4 * cache.layout.bytes_per_block)
    for hash_ in (900, 901):
        (block,) = pool.allocate(1, B)
        pool.cache_full_block(block, hash_, B)
        pool.free([block])
    pool.allocate(4, A)
    for slot, hash_ in enumerate((500, 501, 502)):
        tier.spill(slot, hash_)
    blocks, copied = tier.restore_prefix(pool, [500, 501, 502], A, reserve=0, guarded=guarded)
    assert copied == len(blocks) == (2 if guarded else 3)
    assert pool.held_by("b") == (2 if guarded else 1)
    assert [pool.block_hash(b) for b in blocks] == [500, 501, 502][: len(blocks)]
