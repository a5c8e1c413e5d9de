"""Consistent-hash ring of one worker pool, with virtual nodes.

Lifecycle: the router builds a `HashRing` from a pool's member ids whenever membership
changes (rings are immutable; building one is O(n * virtual_nodes * log)), then calls
`walk(key)` per request to get every member once, in clockwise order from the key. The
bounded-load script takes the first member of that order whose load is below the bound,
so the order is the whole policy's notion of affinity.

Each worker owns `virtual_nodes` points at `XXH3-64(f"{worker_id}#{i}")`; many points
per worker even out the arc each one owns, so adding or removing one worker moves about
1/n of the keys, and only keys that land on, or leave, that worker.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import xxhash


def vnode_position(worker_id: str, index: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{worker_id}#{index}".encode())


class HashRing:
    """Immutable ring over a set of worker ids; deterministic for the same ids."""

    def __init__(self, worker_ids: Iterable[str], virtual_nodes: int = 64) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.members = frozenset(worker_ids)
        self.virtual_nodes = virtual_nodes
        # Ties between equal positions (astronomically rare) break by worker id, so the
        # ring never depends on the iteration order of `worker_ids`.
        points = sorted(
            (vnode_position(w, i), w) for w in self.members for i in range(virtual_nodes)
        )
        self._positions = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.members

    def owner(self, key: int) -> str | None:
        """The first worker clockwise from `key` (None for an empty ring)."""
        return next(self.walk(key), None)

    def walk(self, key: int) -> Iterator[str]:
        """Every member once, clockwise from the first point at or after `key`."""
        n_points = len(self._positions)
        if not n_points:
            return
        start = bisect.bisect_left(self._positions, key & 0xFFFFFFFFFFFFFFFF)
        seen: set[str] = set()
        n_members = len(self.members)
        for step in range(n_points):
            owner = self._owners[(start + step) % n_points]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == n_members:
                    return
