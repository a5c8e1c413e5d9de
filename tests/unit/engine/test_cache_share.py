"""Cache fairness: the prefix cache evicts the tenant holding the most per weight first,
so a tenant flooding distinct prompts cannot push another tenant's hot prefix out.

`CacheShares` on its own, then the scheduler and pool with two tenants (a hot system
prompt against a flood of unique prompts), against the same workload under one shared
least-recently-freed list (both tenants' blocks counted as one tenant's), where the hot
prefix is lost: the comparison shows the test can fail.
"""

from __future__ import annotations

import pytest

from engine.cache_share import CacheOwner, CacheShares
from engine.prefix_hash import hash_seed
from engine.priority import Priority
from tests.unit.engine.scheduler_sim import make_req, make_sim


def _shares(*blocks: tuple[int, CacheOwner]) -> CacheShares:
    """Shares holding `blocks` (id, owner), all parked in the order given."""
    shares = CacheShares()
    for block_id, owner in blocks:
        shares.hold(owner)
        shares.park(block_id, owner.tenant)
    return shares


def test_one_tenant_is_least_recently_freed_first() -> None:
    a = CacheOwner("a")
    shares = _shares((3, a), (1, a), (2, a))
    shares.unpark(1, "a")
    shares.park(1, "a")  # freed again: now the most recent
    assert [shares.evict() for _ in range(3)] == [3, 2, 1]
    with pytest.raises(KeyError):
        shares.evict()


def test_the_tenant_holding_most_per_weight_goes_first() -> None:
    a, b = CacheOwner("a"), CacheOwner("b")
    shares = _shares((0, a), (1, b), (2, b), (3, b))
    assert shares.evict() == 1  # b holds 3 to a's 1, though a's block is older
    shares.release("b")
    assert shares.evict() == 2
    shares.release("b")
    # 1 each now: the tie goes to the tenant that parked first.
    assert shares.evict() == 0
    assert shares.num_parked == 1 and shares.held("a") == 1


def test_weight_entitles_a_tenant_to_more_of_the_cache() -> None:
    heavy, light = CacheOwner("heavy", 4.0), CacheOwner("light", 1.0)
    shares = _shares((0, heavy), (1, heavy), (2, heavy), (3, light), (4, light))
    # heavy holds 3 / 4 = 0.75 per weight, light 2 / 1 = 2: light goes first.
    assert shares.evict() == 3
    with pytest.raises(ValueError, match="weight"):
        CacheOwner("x", 0.0)


def test_blocks_in_use_count_toward_the_holding() -> None:
    a, b = CacheOwner("a"), CacheOwner("b")
    shares = _shares((0, a), (1, b))
    for _ in range(5):
        shares.hold(b)  # b's running requests hold 5 more blocks, none free
    assert shares.evict() == 1
    shares.release("b")
    assert shares.evict() == 0  # only a has a parked block left
    assert [*shares.drain()] == [] and shares.num_parked == 0


def test_drain_unparks_everything_and_forgets_empty_tenants() -> None:
    a, b = CacheOwner("a"), CacheOwner("b")
    shares = _shares((0, a), (1, b), (2, a))
    assert sorted(shares.drain()) == [0, 1, 2]
    for tenant in ("a", "a", "b"):
        shares.release(tenant)
    assert shares.held("a") == shares.held("b") == 0 and shares.parked() == []


def test_an_admission_evicts_only_its_own_or_heavier_tenants_blocks() -> None:
    light, heavy, mid = CacheOwner("light"), CacheOwner("heavy", 2.0), CacheOwner("mid")
    shares = _shares((0, light), (1, heavy), (2, heavy), (3, heavy), (4, heavy), (5, mid))
    for _ in range(3):
        shares.hold(mid)  # mid's running requests: 4 blocks, one parked
    # mid holds 4 per weight; heavy 4 / 2 = 2, light 1: only mid's own block may go.
    assert shares.evictable("mid") == 1
    assert shares.evict("mid", shares.load("mid")) == 5
    shares.release("mid")
    with pytest.raises(KeyError):
        shares.evict("mid", shares.load("mid") + 1)
    # light holds 1: heavy may lose blocks while it holds >= 1 per weight (2 of its 4),
    # mid its none parked, light its own 1.
    assert shares.evictable("light") == 1 + 3
    assert shares.evict("light", 1.0) == 1  # heavy's oldest: it holds the most per weight
    assert shares.evictable() == shares.num_parked == 4  # growth may evict anything


# -- the scheduler and pool --------------------------------------------------------------

SYSTEM = list(range(5000, 5064))  # 64 tokens: 4 blocks of the hot tenant's prompt
ROUNDS = 6
FLOOD = 5  # the flood's requests between two of the hot tenant's
FLOOD_TOKENS = 96  # 6 blocks each: 30 blocks a round, more than the pool's 24


def _hot_hit_tokens(
    hot: CacheOwner, flood: CacheOwner, *, budget: int = 1024, num_blocks: int = 24,
    flood_tokens: int = FLOOD_TOKENS,
) -> list[int]:  # fmt: skip
    """The hot tenant's cached tokens per request, with the flood in between. The default
    budget admits the whole flood in one step (its requests are in flight together); a
    smaller one splits each flood prompt into chunks, so the flood grows as it runs."""
    sim = make_sim(num_blocks=num_blocks, block_size=16, budget=budget)
    hot_seed, flood_seed = hash_seed("m", "hot"), hash_seed("m", "flood")
    hits = []
    for r in range(ROUNDS):
        question = [6000 + r] * 16
        req = make_req(f"hot{r}", SYSTEM + question, 2, seed=hot_seed, owner=hot)
        sim.add(req)
        sim.run()
        hits.append(req.num_cached_tokens)
        for i in range(FLOOD):
            prompt = [7000 + 1000 * r + 100 * i + t % 97 for t in range(flood_tokens)]
            sim.add(make_req(f"flood{r}.{i}", prompt, 2, seed=flood_seed, owner=flood))
        sim.run()
    sim.assert_no_leaks()
    return hits


def test_a_flood_of_unique_prompts_does_not_evict_another_tenants_hot_prefix() -> None:
    fair = _hot_hit_tokens(CacheOwner("hot"), CacheOwner("flood"))
    assert fair == [0] + [64] * (ROUNDS - 1)  # every request after the first hits
    # One list for both (today's least recently freed order): the flood evicts it.
    shared = _hot_hit_tokens(CacheOwner("one"), CacheOwner("one"))
    assert shared == [0] * ROUNDS


def test_a_chunked_flood_preempts_its_own_requests_rather_than_evict_another_tenant() -> None:
    # 48-token steps: each 256-token flood prompt (16 blocks of the pool's 24) is admitted
    # a chunk at a time and grows as it runs, next to other flood requests, while the
    # hot tenant's prefix is parked. Short only because of the guard, the growing
    # request preempts the flood's newest instead of evicting the hot tenant's blocks.
    chunked = {"budget": 48, "flood_tokens": 256}
    fair = _hot_hit_tokens(CacheOwner("hot"), CacheOwner("flood"), **chunked)
    assert fair == [0] + [64] * (ROUNDS - 1)
    shared = _hot_hit_tokens(CacheOwner("one"), CacheOwner("one"), **chunked)
    assert shared == [0] * ROUNDS


def test_a_request_too_big_for_the_rest_of_the_pool_still_runs() -> None:
    # 20 blocks: one 256-token flood prompt (17 with its output) cannot fit beside the
    # hot tenant's 5, and the flood's only running request may take them: progress wins
    # over the share. The hot tenant keeps what the flood did not need.
    hits = _hot_hit_tokens(
        CacheOwner("hot"), CacheOwner("flood"), budget=64, num_blocks=20, flood_tokens=256
    )
    assert hits == [0] + [48] * (ROUNDS - 1)


def test_a_pool_short_for_everyone_still_preempts_by_class_across_tenants() -> None:
    # Nothing is parked: no tenant's share is at stake, so the guard leaves the victim
    # to the classes: the other tenant's sheddables go, newest first, though the
    # critical request's own tenant runs another request it could have preempted.
    sim = make_sim(num_blocks=5, block_size=4)
    mine, theirs = CacheOwner("mine"), CacheOwner("theirs")
    s1 = make_req("s1", range(3), 6, priority=Priority.SHEDDABLE, owner=theirs)
    s2 = make_req("s2", range(100, 103), 6, priority=Priority.SHEDDABLE, owner=theirs)
    std = make_req("std", range(300, 303), 8, owner=mine)
    sim.add(s1, s2, std)
    sim.step()
    crit = make_req("crit", range(200, 203), 8, priority=Priority.CRITICAL, owner=mine)
    sim.add(crit)
    sim.step()
    assert sim.pool.num_tenants == 2 and sim.pool.stats().cached_free == 0
    victims: list[str] = []
    while sim.sched.has_work():
        victims += [v.request_id for v in sim.step().preempted]
    assert victims[:2] == ["s2", "s1"] and crit.num_preemptions == 0
    sim.assert_no_leaks()


def test_a_decode_takes_a_lighter_tenants_free_cached_block_before_preempting_a_stream() -> None:
    # The hot tenant's finished request leaves 2 full blocks parked; two streams of
    # another tenant then decode past what the free blocks hold. A stream's next block
    # is not guarded: the hot tenant's parked blocks go before any stream is preempted.
    sim = make_sim(num_blocks=6, block_size=4)
    hot = make_req("hot", range(8), 1, seed=hash_seed("m", "hot"), owner=CacheOwner("hot"))
    sim.add(hot)
    sim.run()
    assert sim.pool.held_by("hot") == 2
    streams = [make_req(f"s{i}", range(100 * i, 100 * i + 3), 12, owner=CacheOwner("busy"))
               for i in (1, 2)]  # fmt: skip
    sim.add(*streams)
    held_at_first_preemption = None
    while sim.sched.has_work():
        if sim.step().preempted and held_at_first_preemption is None:
            held_at_first_preemption = sim.pool.held_by("hot")
    assert held_at_first_preemption == 0  # 4 blocks a stream: 8 > the 4 left free
    sim.assert_no_leaks()
