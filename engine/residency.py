"""Which prefix blocks this engine holds, and what changed since a reader last asked.

Lifecycle: the engine's builder makes one `ResidencyLog` and hands it to the block pool
and the offload tier. Each tells it when a chained block hash starts or stops being
held there (`add` / `remove`): the pool when it publishes a full block or evicts one,
the tier when it spills, drops, hands back or forgets an entry. A hash is resident
while either tier holds it (a per-hash count, so a block moving from the pool to the
tier, or back, never looks gone). A reader (the worker's residency feed, which publishes
to the router) takes `drain()` every interval: the hashes that became resident and the
ones that stopped being since the previous drain (a hash that came and went, or went
and came back, in between is not reported); or
`snapshot()`, the whole set, which also clears what was pending (a reader starting
over, or one that lost a publish, sends the snapshot instead).

Thread-safe: the engine's step thread writes, the worker's event loop thread reads.
Every call holds one lock for a few dict operations, so a step never waits for long.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ResidencyDelta:
    """Changes since the previous drain (or snapshot); a hash is in at most one list."""

    added: tuple[int, ...]
    removed: tuple[int, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class ResidencyLog:
    """Counts of each resident hash over the tiers that hold it, and pending changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[int, int] = {}
        # hash -> whether it was resident at the last drain, for every hash whose state
        # changed since; the drain reports those whose state now differs from it.
        self._pending: dict[int, bool] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._count)

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._count

    def add(self, block_hash: int) -> None:
        """A tier now holds `block_hash`."""
        with self._lock:
            held = self._count.get(block_hash, 0)
            self._count[block_hash] = held + 1
            if held == 0:
                self._pending.setdefault(block_hash, False)

    def remove(self, block_hash: int) -> None:
        """A tier no longer holds `block_hash`; a hash no tier was counted for is ignored
        (a tier forgetting what it never reported is not an error worth a crash)."""
        with self._lock:
            held = self._count.get(block_hash, 0)
            if held <= 0:
                return
            if held == 1:
                del self._count[block_hash]
                self._pending.setdefault(block_hash, True)
            else:
                self._count[block_hash] = held - 1

    def drain(self) -> ResidencyDelta:
        """The changes since the previous drain or snapshot, and forget them."""
        with self._lock:
            pending, self._pending = self._pending, {}
            now = {h: h in self._count for h, was in pending.items() if (h in self._count) != was}
        added = tuple(h for h, resident in now.items() if resident)
        removed = tuple(h for h, resident in now.items() if not resident)
        return ResidencyDelta(added, removed)

    def snapshot(self) -> tuple[int, ...]:
        """Every resident hash now; pending changes are dropped (the snapshot has them)."""
        with self._lock:
            self._pending = {}
            return tuple(self._count)
