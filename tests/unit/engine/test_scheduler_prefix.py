"""Scheduler and prefix cache: full blocks reused across requests of one tenant, published
as they fill, never shared across tenants or before they are complete."""

from __future__ import annotations

from engine.prefix_hash import hash_seed
from tests.unit.engine.scheduler_sim import (
    assert_complete,
    make_req,
    make_sim,
    token_for,
)


def test_prefix_cache_admission_reuses_full_blocks() -> None:
    sim = make_sim(block_size=16)
    prefix = list(range(1000, 1048))  # 48 tokens: 3 full blocks
    first = make_req("first", prefix, max_tokens=1)
    sim.add(first)
    sim.step()
    assert first.finished
    assert sim.sched.prefix_hit_tokens == 0 and sim.sched.prefix_query_tokens == 48
    assert sim.pool.stats().cached_free == 3

    # Same 48 tokens: at most (48 - 1) // 16 = 2 blocks reused, so >= 1 token computed.
    same = make_req("same", prefix, max_tokens=3)
    sim.add(same)
    batch = sim.sched.schedule()
    assert same.num_computed_tokens == 32
    assert same.num_cached_tokens == 32
    assert batch.prefills == [(same, 16)]
    assert sim.sched.prefix_hit_tokens == 32 and sim.sched.prefix_query_tokens == 96
    hit_blocks = same.block_ids[:2]
    assert [sim.pool.block_hash(b) for b in hit_blocks] == same.block_hashes[:2]
    for req, n in batch.items:  # finish the step as the engine would
        sim.sched.advance(req, n)
        req.output_token_ids.append(token_for(req, 0))
    sim.check_accounting()

    # A longer prompt with the same 48-token prefix reuses all 3 blocks, sharing 2 with
    # the request still running.
    # same's third block was computed again: its hash stays with first's freed copy.
    third = sim.pool.lookup(same.block_hashes[2])
    assert third is not None and third != same.block_ids[2]
    assert sim.pool.block_hash(same.block_ids[2]) is None
    longer = make_req("longer", [*prefix, 1, 2, 3, 4, 5], max_tokens=2)
    sim.add(longer)
    batch = sim.step()
    assert (longer, 5) in batch.prefills
    assert longer.num_cached_tokens == 48
    assert longer.block_ids[:3] == [*hit_blocks, third]
    assert [sim.pool.ref_count(b) for b in hit_blocks] == [2, 2]
    assert sim.sched.prefix_hit_tokens == 80
    assert sim.sched.prefix_query_tokens == 96 + 53
    sim.run()
    assert_complete(same)
    assert_complete(longer)
    sim.assert_no_leaks()


def test_prefix_cache_misses_on_other_tenant_or_changed_head() -> None:
    sim = make_sim(block_size=16)
    prefix = list(range(1000, 1048))
    sim.add(make_req("first", prefix, max_tokens=1))
    sim.run()
    other_tenant = make_req("t", prefix, max_tokens=1, seed=hash_seed("m", "tenant-b"))
    changed = make_req("c", [7, *prefix[1:]], max_tokens=1)
    sim.add(other_tenant, changed)
    batch = sim.step()
    assert batch.prefills == [(other_tenant, 48), (changed, 48)]
    assert other_tenant.num_cached_tokens == 0 and changed.num_cached_tokens == 0
    assert sim.sched.prefix_hit_tokens == 0
    sim.assert_no_leaks()


def test_concurrent_identical_prompts_share_nothing_until_published() -> None:
    sim = make_sim(block_size=16)
    prompt = list(range(64))
    a, b = make_req("a", prompt, 3), make_req("b", prompt, 3)
    sim.add(a, b)
    batch = sim.step()
    assert batch.prefills == [(a, 64), (b, 64)]
    assert not set(a.block_ids) & set(b.block_ids)
    # Only one block per hash is published; the other copy stays uncached.
    assert sim.pool.stats().cached == 4
    sim.run()
    assert_complete(a)
    assert_complete(b)
    sim.assert_no_leaks()


def test_decode_publishes_blocks_as_they_fill() -> None:
    sim = make_sim(block_size=4)
    req = make_req("a", range(6), max_tokens=8)
    sim.add(req)
    sim.step()
    assert sim.pool.block_hash(req.block_ids[0]) == req.block_hashes[0]
    assert sim.pool.block_hash(req.block_ids[1]) is None  # 6 of 8 tokens computed
    sim.step()
    sim.step()  # 8 tokens computed: block 1 is full
    assert req.num_computed_tokens == 8
    assert sim.pool.block_hash(req.block_ids[1]) == req.block_hashes[1]
    sim.run()
    assert sim.pool.stats().cached == 3  # 13 computed tokens: 3 full blocks
    assert_complete(req)
    sim.assert_no_leaks()
