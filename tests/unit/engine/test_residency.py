"""The residency log: what the pool and the offload tier hold, and what changed.

First the log on its own (counts over tiers, deltas reported once, snapshots), then the
pool and the tier reporting to it, then a real engine under eviction pressure with an
offload tier: after every step the log equals the union of what both tiers hold.
"""

from __future__ import annotations

import threading

from engine.block_pool import BlockPool
from engine.kv_offload import OffloadTier
from engine.request_spec import RequestSpec
from engine.residency import ResidencyDelta, ResidencyLog
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.unit.engine.tiny_kv import tiny_kv_cache


def test_a_hash_is_resident_while_any_tier_holds_it() -> None:
    log = ResidencyLog()
    log.add(1)
    log.add(2)
    log.add(1)  # a second tier holds 1 too
    assert log.drain() == ResidencyDelta((1, 2), ())
    log.remove(1)  # one of the two let go: still resident, nothing to report
    assert 1 in log and not log.drain()
    log.remove(1)
    log.remove(2)
    log.remove(3)  # never held: ignored
    assert log.drain() == ResidencyDelta((), (1, 2)) and len(log) == 0


def test_a_delta_reports_changes_since_the_last_drain_and_a_snapshot_clears_them() -> None:
    log = ResidencyLog()
    log.add(5)
    log.drain()
    log.remove(5)
    log.add(5)  # gone and back within one interval: nothing changed
    log.add(6)
    log.remove(6)  # came and went: nothing changed
    log.add(8)
    assert log.drain() == ResidencyDelta((8,), ())
    log.add(7)
    assert sorted(log.snapshot()) == [5, 7, 8] and not log.drain()


def test_concurrent_writers_and_a_reader_end_at_the_true_set() -> None:
    log = ResidencyLog()
    seen: set[int] = set()

    def churn(base: int) -> None:
        for i in range(2000):
            log.add(base + i)
            if i % 3:
                log.remove(base + i)

    def read() -> None:
        for _ in range(200):
            d = log.drain()
            seen.update(d.added)
            seen.difference_update(d.removed)

    threads = [threading.Thread(target=churn, args=(b,)) for b in (0, 10_000)]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = log.drain()
    seen.update(d.added)
    seen.difference_update(d.removed)
    assert seen == set(log.snapshot()) and len(seen) == 2 * 667


def test_the_pool_and_the_tier_report_what_they_hold() -> None:
    cache = tiny_kv_cache(2, num_layers=1)
    pool, tier, log = BlockPool(2), OffloadTier(cache, cache.layout.bytes_per_block), ResidencyLog()
    pool.on_evict, pool.residency, tier.residency = tier.spill, log, log
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 100)
    pool.cache_full_block(b, 101)
    pool.free([b, a])
    assert set(log.drain().added) == {100, 101}
    (c,) = pool.allocate(1)  # evicts 101 (LRU): it spills to the tier, still resident
    assert not log.drain() and tier.hashes() == {101}
    (d,) = pool.allocate(1)  # evicts 100: it spills, dropping 101 (the tier holds one)
    assert log.drain() == ResidencyDelta((), (101,)) and tier.hashes() == {100}
    slot = tier.take(100)  # the scheduler takes it back into a pool block
    tier.restore(slot, c)
    pool.cache_full_block(c, 100)
    assert not log.drain()  # it moved tiers, never left
    pool.free([c, d])
    assert pool.reset_prefix_cache() == 1
    assert log.drain() == ResidencyDelta((), (100,)) and len(log) == 0


def test_an_engine_under_eviction_pressure_logs_exactly_what_it_holds(
    make_engine: EngineFactory,
) -> None:
    """24 blocks of pool, about 16 of tier, prompts of 5-9 blocks sharing heads: blocks are
    published, evicted, spilled, dropped and restored all the time."""
    engine = make_engine(num_kv_blocks=24, kv_offload_bytes=12 << 20)
    assert engine.offload is not None and 8 <= engine.offload.capacity_blocks <= 32
    reported: set[int] = set()
    heads = [[7 + h] * 48 for h in range(3)]  # three 3-block heads
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts: list[list[int]] = []
    for i in range(30):
        # Every fourth prompt repeats an earlier one the pool has evicted since: it comes
        # back from the tier (restores) or is recomputed.
        fresh = heads[i % 3] + [100 + i * 37 + j for j in range(16 * (2 + i % 5))]
        prompt = prompts[i - 6] if i % 4 == 3 and i >= 6 else fresh
        prompts.append(prompt)
        engine.add_request(RequestSpec(prompt, params, request_id=f"r{i}"))
        while engine.has_unfinished():
            engine.step()
            truth = engine.pool.cached_hashes() | engine.offload.hashes()
            delta = engine.residency.drain()
            reported |= set(delta.added)
            reported -= set(delta.removed)
            assert reported == truth
    s = engine.stats()
    assert s.offload_spilled_total > 30 and s.offload_restored_total > 5, s  # it churned
    assert_no_leaks(engine)
