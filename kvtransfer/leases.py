"""Leases on exported KV blocks: pinned until the importer releases them or time runs out.

Lifecycle: `grant` when a prefill engine exports a request's blocks; `release` when the
importer's Release call arrives (its answer, whether the lease was still live, is what
proves a one-sided read safe); `expire_due`, called
periodically by the exporter's housekeeping thread, releases every lease past its expiry
and counts it. Releasing calls `on_release(request_id)` exactly once per lease, which
unpins the blocks in the engine (full blocks stay in its prefix cache). Thread-safe.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # monotonic seconds
    expires_at_unix_ms: int


@dataclass(frozen=True)
class LeaseStats:
    active: int
    pinned_blocks: int
    granted: int
    released: int
    expired: int


class LeaseTable:
    """Active leases by id; every exit path goes through `_end`."""

    def __init__(
        self,
        ttl_s: float,
        on_release: Callable[[str], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self._on_release = on_release
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._granted = self._released = self._expired = 0

    def grant(self, request_id: str, block_ids: list[int]) -> Lease:
        now = self._clock()
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            block_ids=tuple(block_ids),
            expires_at=now + self.ttl_s,
            expires_at_unix_ms=int((time.time() + self.ttl_s) * 1000),
        )
        with self._lock:
            self._leases[lease.lease_id] = lease
            self._granted += 1
        return lease

    def get(self, lease_id: str) -> Lease | None:
        """The lease if it is still active and unexpired."""
        with self._lock:
            lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.expires_at > self._clock() else None

    def release(self, lease_id: str) -> bool:
        """End a lease early (the importer is done); False if unknown or already ended."""
        if self._end(lease_id):
            with self._lock:
                self._released += 1
            return True
        return False

    def release_request(self, request_id: str) -> bool:
        """End the lease held for a request (e.g. the client cancelled before decode)."""
        with self._lock:
            ids = [lid for lid, lease in self._leases.items() if lease.request_id == request_id]
        return any([self.release(lid) for lid in ids])

    def expire_due(self) -> int:
        """End every lease past its expiry; returns how many."""
        now = self._clock()
        with self._lock:
            due = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        ended = sum(1 for lid in due if self._end(lid))
        with self._lock:
            self._expired += ended
        return ended

    def release_all(self) -> int:
        """At shutdown: end every lease."""
        with self._lock:
            ids = list(self._leases)
        return sum(1 for lid in ids if self.release(lid))

    def stats(self) -> LeaseStats:
        with self._lock:
            return LeaseStats(
                active=len(self._leases),
                pinned_blocks=sum(len(lease.block_ids) for lease in self._leases.values()),
                granted=self._granted,
                released=self._released,
                expired=self._expired,
            )

    def _end(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._on_release(lease.request_id)
        return True
