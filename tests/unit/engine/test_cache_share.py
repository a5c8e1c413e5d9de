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


def _hot_hit_tokens(hot: CacheOwner, flood: CacheOwner) -> list[int]:
    """The hot tenant's cached tokens per request, with the flood in between."""
    # A step's budget admits the whole flood at once: its requests are in flight together.
    sim = make_sim(num_blocks=24, block_size=16, budget=1024)
    hot_seed, flood_seed = hash_seed("m", "hot"), hash_seed("m", "flood")
    hits = []
    for r in range(ROUNDS):
        question = [6000 + r] * 16
        req = make_req(f"hot{r}", SYSTEM + question, 2, seed=hot_seed, owner=hot)
        sim.add(req)
        sim.run()
        hits.append(req.num_cached_tokens)
        for i in range(FLOOD):
            prompt = [7000 + 1000 * r + 100 * i + t % 97 for t in range(FLOOD_TOKENS)]
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
