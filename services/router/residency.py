"""The workers' reported prefix caches in Redis: what the router's placement reads.

Lifecycle of one worker's set `ns:resident:<id>`: its feed (`services/worker/residency_feed.py`)
first calls `ResidencyBoard.reset` with every hash its engine holds, then `apply` every
interval with what changed; each call renews the set's expiry (`ttl_s`), so a dead
worker's set is gone soon after its signal. The set carries the marker `~<incarnation>`
of the process that wrote it: `apply` refuses (returns False) when the marker is not
there (the set expired, Redis lost it, or another process of the same worker id wrote
it), and the feed then sends a snapshot again, since a delta on a missing set would be
a partial view. A clean shutdown `withdraw`s it.

Readers: `bounded_load.lua` looks the request's leading block hashes up in each
candidate's set (a set whose marker is not the registered incarnation's is a restarted
worker's: it holds nothing yet); `read` returns one worker's set, for tests and tools.

Hashes travel as 16 lowercase hex digits (`hash_text`), as the router's keys do. Each
call is one script run, so one round trip; Redis errors propagate to the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis

from services.router.keyspace import Keyspace
from services.router.redis_client import router_script

#: Prefix of the member naming the incarnation a set describes (hashes are hex digits).
MARKER_PREFIX = "~"
#: Most hashes one script call writes: a snapshot of a large pool and offload tier is
#: sent in several calls, so no single call holds Redis (every placement waits on it)
#: for long. Between them the set is partial, which only understates a run.
CALL_HASHES = 10_000


def hash_text(block_hash: int) -> str:
    """A block hash as the sets and the placement script spell it."""
    return f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}"


@dataclass(frozen=True)
class Residency:
    """One worker's reported set: the incarnation that wrote it and its hashes."""

    incarnation: str
    hashes: frozenset[int]


class ResidencyBoard:
    """The reported prefix caches of one cluster (namespace)."""

    def __init__(self, client: redis.Redis, keys: Keyspace, ttl_s: float) -> None:
        """`ttl_s`: how long a set lives without a report (the load signal's TTL)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client, self.keys = client, keys  # the client decodes (`redis_client.connect`)
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._script = router_script(client, "residency.lua")

    def reset(self, worker_id: str, incarnation: str, hashes: Iterable[int]) -> None:
        """Replace the worker's set with `hashes`, written by `incarnation` (in calls of
        at most `CALL_HASHES`; a later call that finds the set gone stops: the caller's
        next report resets again)."""
        chunks = _chunks(list(hashes))
        self._call("reset", worker_id, incarnation, chunks[0], ())
        for chunk in chunks[1:]:
            if not self._call("apply", worker_id, incarnation, chunk, ()):
                return

    def apply(
        self, worker_id: str, incarnation: str, added: Iterable[int], removed: Iterable[int]
    ) -> bool:
        """Add and remove hashes; False (nothing changed) if the set is not
        `incarnation`'s any more: the caller must `reset` it."""
        return self._call("apply", worker_id, incarnation, added, removed)

    def withdraw(self, worker_id: str) -> None:
        """Remove the worker's set at once (a clean shutdown); a no-op if there is none."""
        self.client.delete(self.keys.resident(worker_id))

    def read(self, worker_id: str) -> Residency | None:
        """The worker's reported set, or None if it has none (never reported, expired)."""
        members = self.client.smembers(self.keys.resident(worker_id))
        if not members:
            return None
        names = [str(m) for m in members]
        marker = next((m for m in names if m.startswith(MARKER_PREFIX)), MARKER_PREFIX)
        hashes = frozenset(int(m, 16) for m in names if not m.startswith(MARKER_PREFIX))
        return Residency(marker[len(MARKER_PREFIX) :], hashes)

    def _call(
        self,
        op: str,
        worker_id: str,
        incarnation: str,
        added: Iterable[int],
        removed: Iterable[int],
    ) -> bool:
        plus = [hash_text(h) for h in added]
        minus = [hash_text(h) for h in removed]
        marker = MARKER_PREFIX + incarnation
        res = self._script(keys=[self.keys.resident(worker_id)],
                           args=[op, self.ttl_ms, marker, len(plus), *plus, *minus])  # fmt: skip
        return int(str(res)) == 1


def _chunks(hashes: list[int]) -> list[list[int]]:
    """`hashes` in runs of at most `CALL_HASHES`; one empty run for none."""
    return [hashes[i : i + CALL_HASHES] for i in range(0, len(hashes), CALL_HASHES)] or [[]]
