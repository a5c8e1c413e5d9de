"""The router's last known worker membership, per pool, with a hash ring per pool.

Lifecycle: `Router` calls `Membership.update` with each registry read; it swaps in a new
immutable `MembershipView`, reusing a pool's ring while its non-draining members are the
same. Each decision takes one `view()` and uses only it, so a concurrent refresh never
mixes two memberships in one decision. The view is also what fail-open routes on.

Redis losing its data (a new epoch token) starts a resync window of one heartbeat TTL:
a pool the registry does not list yet keeps its last membership, marked local-only (the
router places there with local counts), until heartbeats re-register its workers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.model_identity import ModelIdentity
from services.common.role import Role
from services.router.placement import WorkerRef
from services.router.registry import WorkerInfo
from services.router.ring import HashRing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MembershipView:
    """One consistent membership. Treat every field as read-only."""

    pools: dict[str, dict[str, WorkerInfo]] = field(default_factory=dict)  # role -> id -> info
    rings: dict[str, HashRing] = field(default_factory=dict)  # role -> non-draining ring
    local_only: frozenset[str] = frozenset()  # pools kept from before Redis lost its data
    model: str = ""  # model fingerprint the workers share ("" if none known)
    identity: ModelIdentity | None = None  # its parts, as a worker published them

    def serving_roles(self) -> tuple[str, ...]:
        """("prefill", "decode") when both pools have workers, else ("mixed",), else
        ("decode",), else (). A lone decode pool serves whole requests, prefilling its own
        prompts (a run-time role change moved its prefill worker to it). Prefill workers
        alone serve nothing: they have lost every decode worker, which is an outage to
        report, not a pool to pile every stream on."""
        if self.pools.get("prefill") and self.pools.get("decode"):
            return ("prefill", "decode")
        for role in ("mixed", "decode"):
            if self.pools.get(role):
                return (role,)
        return ()

    def ring(self, role: str) -> HashRing:
        return self.rings.get(role) or HashRing(())

    def live(self, role: str, order: Iterable[str]) -> list[str]:
        """`order` minus workers not known or draining."""
        pool = self.pools.get(role, {})
        return [w for w in order if w in pool and not pool[w].draining]

    def holders_first(self, role: str, order: Sequence[str], adapter: str) -> list[str]:
        """`order` with the workers that held LoRA `adapter` at their last heartbeat
        moved to the front, each group in its own order: the bounded-load pick then
        takes a holder while one is under the bound, and falls back to the ring walk
        (which loads the adapter there) when none is."""
        pool = self.pools.get(role, {})
        holds = [w for w in order if w in pool and adapter in pool[w].adapters]
        held = set(holds)
        return holds + [w for w in order if w not in held]

    def is_local_only(self, roles: Iterable[str]) -> bool:
        return any(r in self.local_only for r in roles)

    def ref(self, role: str, worker_id: str) -> WorkerRef:
        info = self.pools.get(role, {}).get(worker_id)
        # A worker Redis placed on but this view has not seen yet (registered since the
        # last refresh) cannot happen: candidates come from this view. Guard anyway.
        address = info.address if info else ""
        return WorkerRef(worker_id, address, role)

    def refs(self) -> list[WorkerRef]:
        return [
            WorkerRef(w.worker_id, w.address, w.role)
            for role in Role
            for w in self.pools.get(role, {}).values()
        ]

    def why_empty(self) -> str:
        if self.pools.get("prefill"):
            return "no decode worker is registered (prefill workers need decode workers)"
        return "no worker is registered with the router; start prefill+decode or mixed workers"

    def why_none(self, role: str, excluded: frozenset[str]) -> str:
        pool = self.pools.get(role, {})
        draining = sum(1 for w in pool.values() if w.draining)
        tried = sum(1 for w in pool if w in excluded)
        return (
            f"no {role} worker can take the request: {len(pool)} registered, {draining} "
            f"draining, {tried} already tried"
        )


class Membership:
    """Holder of the current `MembershipView`; `update` is serialised, `view` is lock-free."""

    def __init__(self, virtual_nodes: int, resync_s: float) -> None:
        self.virtual_nodes = virtual_nodes
        self.resync_s = resync_s
        self._view = MembershipView()
        self._epoch: str | None = None
        self._resync_until = float("-inf")
        self._lock = threading.Lock()

    def view(self) -> MembershipView:
        return self._view

    def update(self, workers: Sequence[WorkerInfo], epoch: str, now: float) -> None:
        """Install the registry's `workers`, read under Redis data epoch `epoch` at `now`."""
        with self._lock:
            old = self._view
            if self._epoch is not None and epoch != self._epoch:
                self._resync_until = now + self.resync_s
                log.warning(
                    "Redis lost its data (restart or flush): keeping the last known workers "
                    "for up to %.1fs while their heartbeats re-register them",
                    self.resync_s,
                )
            self._epoch = epoch
            fresh: dict[str, dict[str, WorkerInfo]] = {r.value: {} for r in Role}
            for w in workers:
                fresh[w.role][w.worker_id] = w
            pools: dict[str, dict[str, WorkerInfo]] = {}
            rings: dict[str, HashRing] = {}
            local_only: set[str] = set()
            for role in Role:
                if not fresh[role] and old.pools.get(role) and now < self._resync_until:
                    pools[role] = old.pools[role]
                    local_only.add(role)
                else:
                    pools[role] = fresh[role]
                serving = frozenset(w for w, info in pools[role].items() if not info.draining)
                ring = old.rings.get(role)
                if ring is None or ring.members != serving:
                    ring = HashRing(serving, self.virtual_nodes)
                rings[role] = ring
            infos = [w for pool in pools.values() for w in pool.values()]
            model = infos[0].model if infos else ""
            identity = next((w.identity for w in infos if w.identity is not None), None)
            self._view = MembershipView(pools, rings, frozenset(local_only), model, identity)
