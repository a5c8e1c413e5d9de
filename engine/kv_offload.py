"""The prefix cache's second tier: evicted blocks spill to host memory and come back.

Lifecycle: the engine makes one `OffloadTier(kv_cache, budget_bytes)` when
`--kv-offload-bytes` is set, and hands it to the block pool as its spill hook and to the
scheduler as its second tier. When the pool evicts a free cached block to reuse it,
`spill` copies the block's bytes (every layer's K and V, and an 8-bit cache's scales)
into a free slot of the arena under the block's chained hash, evicting the tier's
least recently used entry when full. When the scheduler's prefix lookup runs past the
pool's hits, `take` removes the next hash's slot from the index (so nothing spilled
meanwhile can reuse it), the scheduler allocates a pool block, and `restore` copies the
bytes back and frees the slot. An entry lives until it is restored, evicted by newer
spills, or the tier is reset. With a residency log, each entry's hash is reported to
it as the entry comes and goes (engine/residency.py).

Preemption by swap: the scheduler `keep`s the hashes of a preempted request's full
blocks until it resumes or ends (`unkeep`). Its blocks reach the tier the way any
evicted block does, when the pool gives them up (a block the pool never needed is not
copied at all), and a full tier drops its oldest entry that is not kept before any
kept one, so a preempted request gets its KV back on resume unless the kept entries
alone overflow the tier. `restore` times its copies (`OffloadStats.restore_s`), for the
scheduler's choice between copying back and recomputing (engine/restore_gate.py).

Where the arena lives: host memory in both cases; pinned on CUDA so the copies run at
PCIe speed, a plain (huge-page advised) tensor on CPU, where the "second tier" buys
room beyond the pool's own budget rather than a faster medium. A copy is one block row
(the pool is block-major), so a spill or a restore is one memcpy.

Not thread-safe: the engine calls it from its step thread, as it does the pool.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.cache_share import CacheOwner
from engine.kv_cache import KvCache
from engine.kv_layout import allocate_blocks
from engine.residency import ResidencyLog


@dataclass(frozen=True)
class OffloadStats:
    """Counts since engine start; `blocks` / `capacity_blocks` are current."""

    blocks: int
    capacity_blocks: int
    bytes_per_block: int
    spilled: int  # blocks copied in from the pool
    restored: int  # blocks copied back (prefix hits served by the tier)
    dropped: int  # entries evicted by newer spills
    reserved: int  # slots taken and not yet restored (0 between steps)
    kept: int = 0  # hashes kept for preempted requests (held here or still in the pool)
    restore_s: float = 0.0  # wall time of the `restored` copies


class OffloadTier:
    """An LRU arena of evicted prefix blocks, keyed by their chained hash."""

    def __init__(self, kv_cache: KvCache, budget_bytes: int) -> None:
        layout = kv_cache.layout
        slots = budget_bytes // layout.bytes_per_block
        if slots < 1:
            raise ValueError(
                f"kv_offload_bytes={budget_bytes} is below one block ({layout.bytes_per_block} "
                "bytes)"
            )
        self._pool = kv_cache.blocks
        self._arena = allocate_blocks(layout, slots, torch.device("cpu"))
        if self._pool.is_cuda:
            self._arena = self._arena.pin_memory()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._free = list(range(slots - 1, -1, -1))
        self.capacity_blocks = slots
        self._spilled = self._restored = self._dropped = 0
        self._restore_s = 0.0
        self._kept: Counter[int] = Counter()  # hash -> preempted requests keeping it
        #: Told of every hash the tier starts or stops holding (the worker's index feed).
        self.residency: ResidencyLog | None = None

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def hashes(self) -> frozenset[int]:
        """Every hash the tier holds now (O(entries): for checks)."""
        return frozenset(self._slot_of)

    def spill(self, block_id: int, block_hash: int) -> None:
        """Copy a pool block that is about to be reused into the tier (before it is)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        if not self._free:
            dropped = self._drop_candidate()
            self._free.append(self._slot_of.pop(dropped))
            self._dropped += 1
            self._forgot(dropped)
        slot = self._free.pop()
        self._arena[slot].copy_(self._pool[block_id])
        self._slot_of[block_hash] = slot
        self._spilled += 1
        if self.residency is not None:
            self.residency.add(block_hash)

    def _drop_candidate(self) -> int:
        """The entry a full tier gives up: the oldest not kept, else the oldest."""
        if self._kept:
            for block_hash in self._slot_of:
                if block_hash not in self._kept:
                    return block_hash
        return next(iter(self._slot_of))

    def keep(self, hashes: Iterable[int]) -> None:
        """Drop these hashes' entries (now or once spilled) only after every other."""
        self._kept.update(hashes)

    def unkeep(self, hashes: Iterable[int]) -> None:
        """Undo one `keep` of these hashes."""
        for block_hash in hashes:
            left = self._kept[block_hash] - 1
            if left > 0:
                self._kept[block_hash] = left
            else:
                self._kept.pop(block_hash, None)

    def take(self, block_hash: int) -> int:
        """Remove a hash's entry and return its slot, reserved until `restore`."""
        slot = self._slot_of.pop(block_hash)
        self._forgot(block_hash)
        return slot

    def restore(self, slot: int, block_id: int) -> None:
        """Copy a taken slot's bytes into a pool block and free the slot."""
        start = time.perf_counter()
        self._pool[block_id].copy_(self._arena[slot])  # synchronous, so the timing holds
        self._restore_s += time.perf_counter() - start
        self._free.append(slot)
        self._restored += 1

    def restore_prefix(
        self, pool: BlockPool, block_hashes: Sequence[int], owner: CacheOwner, *,
        reserve: int, guarded: bool,
    ) -> tuple[list[int], int]:  # fmt: skip
        """Continue a prefix hit past the pool's blocks: for each hash in order, the pool's
        block if it has one (a reference taken), else this tier's bytes copied into a new
        block of `owner`'s and published. Stops at the first hash neither holds, or once
        no more than `reserve` blocks `owner` may take would be left (`guarded`: only those
        its tenant may evict, `BlockPool.num_free_for`). Returns the blocks and how many
        were copied from the tier."""
        out: list[int] = []
        copied = 0
        for block_hash in block_hashes:
            cached = pool.lookup(block_hash)
            if cached is not None:
                pool.touch([cached])
            elif block_hash not in self or pool.num_free_for(owner if guarded else None) <= reserve:
                break
            else:
                slot = self.take(block_hash)  # reserved: the allocation's spill can't reuse it
                (cached,) = pool.allocate(1, owner, guarded=guarded)
                self.restore(slot, cached)
                pool.cache_full_block(cached, block_hash, owner)
                copied += 1
            out.append(cached)
        return out, copied

    def reset(self) -> int:
        """Forget every entry; returns how many were dropped."""
        n = len(self._slot_of)
        self._free.extend(self._slot_of.values())
        for block_hash in self._slot_of:
            self._forgot(block_hash)
        self._slot_of.clear()
        return n

    def _forgot(self, block_hash: int) -> None:
        if self.residency is not None:
            self.residency.remove(block_hash)

    def restore_s_per_block(self) -> float | None:
        """Mean wall time of one restore's copy so far (None before the first); cheaper
        than `stats()` for the per-block question the restore gate asks."""
        return self._restore_s / self._restored if self._restored else None

    def stats(self) -> OffloadStats:
        return OffloadStats(
            blocks=len(self._slot_of),
            capacity_blocks=self.capacity_blocks,
            bytes_per_block=int(self._arena.shape[1]),
            spilled=self._spilled,
            restored=self._restored,
            dropped=self._dropped,
            reserved=self.capacity_blocks - len(self._free) - len(self._slot_of),
            kept=len(self._kept),
            restore_s=self._restore_s,
        )
