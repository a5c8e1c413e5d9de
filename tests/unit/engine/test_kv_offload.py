"""The offload tier: the arena on its own, then an engine whose evicted prefix comes back.

The engine tests use a pool too small for two long prompts, so running a second one
evicts the first's cached blocks; with a tier they spill there and the first prompt's
rerun restores them instead of recomputing, with the same output.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import LLMEngine
from engine.kv_offload import OffloadTier
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import long_prompt
from tests.unit.engine.tiny_kv import tiny_kv_cache


def test_the_arena_keeps_the_most_recent_spills_and_restores_their_bytes() -> None:
    cache = tiny_kv_cache(4)
    tier = OffloadTier(cache, 2 * cache.layout.bytes_per_block)
    for b in range(3):
        cache.blocks[b] = b + 1
    tier.spill(0, 100)
    tier.spill(1, 101)
    tier.spill(2, 102)  # full: the least recent (100) goes
    assert 100 not in tier and 101 in tier and 102 in tier
    slot = tier.take(101)
    assert 101 not in tier and tier.stats().reserved == 1
    tier.restore(slot, 3)
    assert torch.equal(cache.blocks[3], cache.blocks[1])
    s = tier.stats()
    assert (s.blocks, s.spilled, s.restored, s.dropped, s.reserved) == (1, 3, 1, 1, 0)
    assert tier.reset() == 1 and len(tier) == 0
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        OffloadTier(cache, 10)


def _other_prompt() -> list[int]:
    """1,400 tokens sharing no block with long_prompt (whose texts share a head)."""
    return [17 + (i * 7919) % 40000 for i in range(1400)]


def _run(engine: LLMEngine, prompt: list[int]) -> list[int]:
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=8))
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_an_evicted_prefix_comes_back_from_the_tier(
    make_engine: EngineFactory, kv_dtype: str
) -> None:
    engine = make_engine(num_kv_blocks=96, kv_offload_bytes=256 << 20, kv_cache_dtype=kv_dtype)
    first = engine.tokenizer.encode(long_prompt(6))
    other = _other_prompt()
    # The pool (96 blocks) holds one of them, not both: `other` evicts most of `first`.
    assert len(first) // 16 == 44 and len(other) // 16 == 87
    want = _run(engine, first)
    _run(engine, other)  # evicts `first`'s cached blocks: they spill to the tier
    s = engine.stats()
    assert s.offload_spilled_total > 0 and s.offload_blocks == s.offload_spilled_total
    hits_before = s.prefix_hit_tokens
    assert _run(engine, first) == want
    s = engine.stats()
    restored = s.offload_restored_total
    assert restored >= 30, s  # what the pool lost came back from the tier
    assert s.offload_hit_tokens == 16 * restored
    assert s.prefix_hit_tokens - hits_before >= s.offload_hit_tokens
    assert_no_leaks(engine)


def test_without_a_tier_the_evicted_prefix_is_recomputed(make_engine: EngineFactory) -> None:
    engine = make_engine(num_kv_blocks=96)
    first = engine.tokenizer.encode(long_prompt(6))
    _run(engine, first)
    _run(engine, _other_prompt())
    hits_before = engine.stats().prefix_hit_tokens
    _run(engine, first)
    s = engine.stats()
    assert s.prefix_hit_tokens - hits_before <= 16 * 10 and s.offload_capacity_blocks == 0
    assert_no_leaks(engine)
