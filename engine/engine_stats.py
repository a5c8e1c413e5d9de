"""Taking an engine's `EngineStats` snapshot from the parts that keep each count.

Lifecycle: the engine calls `collect_stats` under its step lock (at the start of a step,
and from `LLMEngine.stats()` between steps); the snapshot is immutable and read by any
thread afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.kv_layout import KvLayout
from engine.kv_offload import OffloadTier
from engine.lora_set import LoraSet
from engine.scheduler import Scheduler
from engine.speculation import Speculator
from engine.stats import ClassCounts, EngineStats
from engine.step_meter import StepMeter, prefill_backlog


@dataclass(frozen=True)
class StatsSources:
    """Where each count lives."""

    pool: BlockPool
    scheduler: Scheduler
    meter: StepMeter
    layout: KvLayout
    speculator: Speculator
    loras: LoraSet
    offload: OffloadTier | None


def collect_stats(src: StatsSources) -> EngineStats:
    """The counts now. Call under the engine's step lock."""
    p = src.pool.stats()
    sched = src.scheduler
    held_blocks, importing_blocks = sched.handoff_blocks()
    m = src.meter
    lora = src.loras.counts()
    return EngineStats(
        total_blocks=p.total,
        free_blocks=p.free,
        used_blocks=p.used,
        cached_blocks=p.cached,
        held_blocks=held_blocks,
        importing_blocks=importing_blocks,
        running=len(sched.running),
        waiting=len(sched.waiting),
        held_requests=len(sched.held),
        importing_requests=len(sched.importing),
        prefix_hit_tokens=sched.prefix_hit_tokens,
        prefix_query_tokens=sched.prefix_query_tokens,
        num_preemptions=sched.num_preemptions,
        swapped_in_tokens_total=sched.swapped_in_tokens,
        recomputed_tokens_total=sched.recomputed_tokens,
        waiting_by_class=ClassCounts.of(r.priority for r in sched.waiting),
        running_by_class=ClassCounts.of(r.priority for r in sched.running),
        preemptions_by_class=ClassCounts(*sched.preemptions_by_class),
        waiting_tokens_by_class=prefill_backlog(sched.waiting, sched.running),
        prefill_tokens_total=m.prefill_tokens,
        decode_only_busy_s_total=m.decode_only_busy_s,
        decode_roof_s_total=m.decode_roof_s,
        memory_bandwidth_bytes_s=m.roof.bandwidth_bytes_s if m.roof is not None else 0.0,
        prefill_busy_s_total=m.prefill_busy_s,
        decode_tokens_total=m.decode_tokens,
        decode_steps_total=m.decode_steps,
        decode_busy_s_total=m.decode_busy_s,
        busy_s_total=m.busy_s,
        kv_bytes_per_token=src.layout.bytes_per_token,
        kv_pool_bytes=p.total * src.layout.bytes_per_block,
        block_size=src.layout.block_size,
        spec_drafted_total=src.speculator.drafted_total,
        spec_accepted_total=src.speculator.accepted_total,
        spec_verifications_total=src.speculator.verifications_total,
        lora_resident=lora.resident,
        lora_held=lora.held,
        lora_loads_total=lora.loads,
        lora_evictions_total=lora.evictions,
        **_offload_stats(src),
    )


def _offload_stats(src: StatsSources) -> dict[str, int]:
    if src.offload is None:
        return {}
    o = src.offload.stats()
    return {
        "offload_blocks": o.blocks,
        "offload_capacity_blocks": o.capacity_blocks,
        "offload_hit_tokens": src.scheduler.offload_hit_tokens,
        "offload_spilled_total": o.spilled,
        "offload_restored_total": o.restored,
    }
