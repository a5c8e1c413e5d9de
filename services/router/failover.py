"""What a router does when Redis's primary changes under it (a Sentinel failover).

Lifecycle: the router reads the primary's replication id (`INFO replication`,
`master_replid`) with every registry refresh and hands it to `Failover.observe`. A
promoted replica takes a new id, so an id different from the last one seen means a new
primary (a restarted standalone Redis also gets one; it comes back empty, so there is
nothing to fix). From then until it is done, each refresh calls `reconcile`, which runs
`reconcile_load.lua` on every pool: the load leases the new primary inherited are
trimmed to what each worker's own signal says it runs, once per pool cluster-wide
(whichever router gets there first; the rest find it done). A pool waits for its
workers to publish a signal after the failover, up to `give_up_s`.

Why: replication is asynchronous, so a replica promoted after its primary was killed
may lack the last releases, and those leases would count against their workers until
their TTL. The workers, not the replica, know what they run. Leases the new primary
lacks (taken just before the kill) only make counts low until their requests end; a
release of a lease that is gone is a no-op.

Redis errors propagate: the router handles them as for any Redis call.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import redis

from services.router.keyspace import Keyspace


class ReconcileState(enum.StrEnum):
    DONE = "done"  # this call trimmed the pool
    PENDING = "pending"  # a worker has not published since the failover: call again
    ALREADY = "already"  # another router did it


@dataclass(frozen=True)
class PoolReconciled:
    role: str
    state: ReconcileState
    trimmed: int  # inherited leases removed (0 unless DONE)


class Failover:
    """One router's view of which primary it talks to, and the reconcile it owes."""

    def __init__(
        self, client: redis.Redis, keys: Keyspace, lease_ttl_s: float, give_up_s: float
    ) -> None:
        self.client = client
        self.keys = keys
        self.lease_ttl_ms = max(1, round(lease_ttl_s * 1000))
        self.give_up_ms = max(0, round(give_up_s * 1000))
        self._script = client.register_script(
            resources.files("services.router").joinpath("reconcile_load.lua").read_text()
        )
        self._lock = threading.Lock()
        self._replid = ""
        self._owed = ""  # the replid whose reconcile is not finished ("" = none)

    def observe(self, replid: str) -> bool:
        """Note the primary's replication id; True if it is a new primary. An empty id
        (a Redis that does not answer INFO, as some managed ones) changes nothing."""
        if not replid:
            return False
        with self._lock:
            changed = bool(self._replid) and replid != self._replid
            self._replid = replid
            if changed:
                self._owed = replid
            return changed

    @property
    def owed(self) -> bool:
        with self._lock:
            return bool(self._owed)

    def reconcile(self, roles: Sequence[str]) -> list[PoolReconciled]:
        """Run the owed reconcile on `roles`; clears the debt once no pool is pending."""
        with self._lock:
            replid = self._owed
        if not replid:
            return []
        out = [self._pool(replid, role) for role in roles]
        if all(r.state is not ReconcileState.PENDING for r in out):
            with self._lock:
                if self._owed == replid:
                    self._owed = ""
        return out

    def _pool(self, replid: str, role: str) -> PoolReconciled:
        k = self.keys
        keys = [k.load(role), k.count(role), k.pool(role), k.reconcile(replid, role)]
        args: list[str | int] = [k.signal_prefix, self.lease_ttl_ms, self.give_up_ms]
        state, trimmed = self._script(keys=keys, args=args)
        return PoolReconciled(role, ReconcileState(str(state)), int(trimmed))


def replication_id(info: object) -> str:
    """The `master_replid` of an `INFO replication` reply ("" if absent, or if the reply
    is an error: a managed Redis may refuse INFO, and then failover goes unnoticed)."""
    return str(info.get("master_replid", "")) if isinstance(info, dict) else ""
