"""Load leases kept in this process: the router's fail-open path while Redis is down.

Lifecycle: while Redis is unreachable (or has not yet been re-populated by heartbeats
after losing its data), `Router` places requests here with the same pick rules as the
Lua script, on the last known membership. Leases expire after their TTL like Redis ones;
`release` drops one and says whether it was local, so the router sends only the others to
Redis. The counts are this replica's own: the bound holds per replica, not cluster-wide,
which is the price of staying up.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence

from services.router.keyspace import lease_id
from services.router.load import Placed, choose, new_token


class LocalLoad:
    """Thread-safe per-process lease table with expiry by `clock` (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[str, str, float]] = {}  # id -> (role, worker, expiry)
        self._counts: dict[tuple[str, str], int] = {}
        self._rr: dict[str, int] = {}
        self._expiries: list[tuple[float, str]] = []  # heap; released ids are skipped

    def place(
        self, role: str, candidates: Sequence[str], mode: str, eps: float, ttl_s: float
    ) -> Placed | None:
        """Like `LoadLedger.place`, but `candidates` must already be live, non-draining."""
        if not candidates:
            return None
        with self._lock:
            now = self._clock()
            self._purge(now)
            loads = [self._counts.get((role, w), 0) for w in candidates]
            rr = self._rr.get(role, 0) + 1
            if mode == "round_robin":
                self._rr[role] = rr
            pick, bound, total = choose(mode, loads, eps, rr)
            worker = candidates[pick]
            lease = lease_id(role, "L" + new_token(), worker)
            self._leases[lease] = (role, worker, now + ttl_s)
            heapq.heappush(self._expiries, (now + ttl_s, lease))
            self._counts[(role, worker)] = loads[pick] + 1
        return Placed(worker, lease, loads[pick], bound, len(candidates), total, pick, True)

    def release(self, lease: str) -> bool:
        """Drop a local lease; False if it is not (or no longer) one of ours."""
        with self._lock:
            entry = self._leases.pop(lease, None)
            if entry is not None:
                self._dec(entry[0], entry[1])
            if len(self._expiries) > 2 * len(self._leases) + 1024:
                # Released leases linger in the heap until their expiry; compact them away.
                self._expiries = [(exp, k) for k, (_, _, exp) in self._leases.items()]
                heapq.heapify(self._expiries)
            return entry is not None

    def counts(self, role: str) -> dict[str, int]:
        with self._lock:
            self._purge(self._clock())
            return {w: c for (r, w), c in self._counts.items() if r == role}

    def _purge(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, lease = heapq.heappop(self._expiries)
            entry = self._leases.pop(lease, None)
            if entry is not None:
                self._dec(entry[0], entry[1])

    def _dec(self, role: str, worker: str) -> None:
        left = self._counts[(role, worker)] - 1
        if left:
            self._counts[(role, worker)] = left
        else:
            del self._counts[(role, worker)]
