"""Preemption by swap: a preempted request's blocks wait in the offload tier, kept there
ahead of other entries, and come back on resume instead of being computed again.

The tier's keep order and the restore gate on their own, then the real model (bf16, the
default compute): a sheddable long request preempted by a critical one resumes with the
same greedy tokens whether its KV was swapped back or recomputed, and as when it ran
alone; swapping copies its blocks back, recomputing computes them. Leak checks after
each, the tier's kept hashes included.
"""

from __future__ import annotations

import pytest

from engine.config import KvRestore
from engine.engine import LLMEngine
from engine.kv_offload import OffloadTier
from engine.priority import Priority
from engine.request_spec import RequestSpec
from engine.restore_gate import RestoreGate
from engine.sampling_params import SamplingParams
from engine.step_meter import StepMeter
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import long_prompt
from tests.unit.engine.tiny_kv import tiny_kv_cache


def _tier(slots: int) -> OffloadTier:
    cache = tiny_kv_cache(8)
    return OffloadTier(cache, slots * cache.layout.bytes_per_block)


def test_a_full_tier_drops_entries_nobody_keeps_first() -> None:
    tier = _tier(2)
    tier.keep([100])
    tier.spill(0, 100)
    tier.spill(1, 101)
    tier.spill(2, 102)  # full: 101 goes, though 100 is older
    assert 100 in tier and 101 not in tier and 102 in tier
    tier.spill(3, 103)  # 102 goes
    assert 100 in tier and 103 in tier and tier.stats().kept == 1
    tier.keep([100])  # a second preempted request with the same prefix
    tier.unkeep([100])
    tier.spill(4, 104)  # still kept once: 103 goes
    assert 100 in tier and 104 in tier
    tier.unkeep([100])
    tier.spill(5, 105)  # nobody keeps it now: the oldest goes
    assert 100 not in tier and tier.stats().kept == 0


def test_the_gate_copies_back_while_copying_is_faster() -> None:
    tier, meter = _tier(2), StepMeter()
    gate = RestoreGate(KvRestore.FASTER, tier, meter, block_size=4)
    assert gate.pays()  # nothing measured yet: copy, and so measure
    tier.spill(0, 100)
    tier.restore(tier.take(100), 1)
    copy_s, _ = gate.costs()
    assert copy_s is not None and copy_s > 0
    meter.prefill_tokens, meter.prefill_busy_s = 1000, 1000 * copy_s  # a block: 4 copies
    assert gate.pays()
    meter.prefill_busy_s = 1000 * copy_s / 8  # a block's prefill: half a copy
    assert not gate.pays()
    assert RestoreGate(KvRestore.ALWAYS, tier, meter, 4).pays()
    assert not RestoreGate(KvRestore.NEVER, tier, StepMeter(), 4).pays()


# -- the real model -----------------------------------------------------------------------

TOKENS = 24


def _engine(make_engine: EngineFactory, restore: KvRestore) -> LLMEngine:
    return make_engine(dtype="bfloat16", num_kv_blocks=40, kv_offload_bytes=64 << 20,
                       kv_restore=restore, max_num_batched_tokens=64)  # fmt: skip


def _preempted_run(engine: LLMEngine) -> list[int]:
    """The sheddable request's tokens when a critical one preempts it mid-decode."""
    prompt = engine.tokenizer.encode(long_prompt(5))[:400]  # 25 of the pool's 40 blocks
    greedy = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    rid = engine.add_request(RequestSpec(prompt, greedy, priority=Priority.SHEDDABLE))
    tokens: list[int] = []
    while len(tokens) < 6:
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    # Another tenant's 24 blocks (no prefix shared), admitted a chunk at a time: growing
    # past the free blocks, it preempts the lower class.
    other = engine.tokenizer.encode(long_prompt(8))[:380]
    engine.add_request(RequestSpec(other, SamplingParams(max_tokens=4), cache_salt="other",
                                   priority=Priority.CRITICAL))  # fmt: skip
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert engine.stats().num_preemptions == 1
    assert_no_leaks(engine)
    return tokens


@pytest.fixture(scope="module")
def alone(make_engine: EngineFactory) -> list[int]:
    engine = make_engine(dtype="bfloat16", num_kv_blocks=256)
    prompt = engine.tokenizer.encode(long_prompt(5))[:400]
    (tokens,) = engine.generate([prompt], SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    return tokens


def test_a_preempted_request_swaps_back_in_with_the_same_tokens_as_recomputing(
    make_engine: EngineFactory, alone: list[int]
) -> None:
    swap = _engine(make_engine, KvRestore.ALWAYS)
    assert _preempted_run(swap) == alone
    s = swap.stats()
    # Of its 25 full blocks, those the critical request's allocations took came back
    # from the tier; only the partial tail block was computed again.
    assert s.swapped_in_tokens_total >= 5 * 16 and s.recomputed_tokens_total < 16, s
    recompute = _engine(make_engine, KvRestore.NEVER)
    assert _preempted_run(recompute) == alone
    r = recompute.stats()
    assert r.swapped_in_tokens_total == 0 and r.offload_restored_total == 0, r
    assert r.recomputed_tokens_total == s.recomputed_tokens_total + s.swapped_in_tokens_total
