"""Load releases Redis did not get, kept to send again once it answers.

Lifecycle: the router `add`s the lease ids of a release that failed (a timeout or a lost
connection) or that it skipped while Redis counts as down; the next release or registry
read that reaches Redis `take`s them all and sends them with its own. Without this, one
slow Redis reply on a busy host left that request's workers counted as loaded until the
load TTL (60 s), which skews the bound for every later placement.

Sending a lease twice is harmless: `release_load.lua` skips a lease that is no longer in
the ledger (released already, or expired and purged). The backlog is bounded; past
`limit` the oldest ids go first, since those are the likeliest to have expired anyway.
Thread-safe: the gateway calls the router from many worker threads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

BACKLOG_LIMIT = 100_000  # lease ids (~50 bytes each): ~5 MB at worst


class ReleaseBacklog:
    def __init__(self, limit: int = BACKLOG_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._ids: deque[str] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, lease_ids: Sequence[str]) -> None:
        with self._lock:
            self._ids.extend(lease_ids)

    def take(self) -> list[str]:
        """Every kept id, oldest first; the backlog is empty afterwards."""
        with self._lock:
            out = list(self._ids)
            self._ids.clear()
        return out
