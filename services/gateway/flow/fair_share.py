"""Each tenant's attained service, cluster-wide: the ledger every gateway replica shares.

Lifecycle: the admission controller calls `sync` once per tick (one Redis round trip,
`fair_share.lua`) with the KV-block-seconds its live requests held since the last tick,
per class and tenant, divided by the tenant's weight, and the tenants it has waiting.
Redis adds the charges to decaying totals (half-life `half_life_s`: the window that
counts), marks the backlogged tenants for `backlog_ttl_s`, and returns every tenant's
decayed total and whether some replica has it waiting. The returned `FairView` answers
`over_share(class, tenant)` until the next tick: a tenant is over its share when its
weight-normalised service exceeds the least-served backlogged tenant's of its class by
more than `SLACK`; the waiting room then holds it back (see `WaitingRoom.pick`), so two
gateways splitting one tenant's traffic do not give it twice its share.

Fail-open, like the token quota: if Redis is unreachable the view is empty (nobody is
held; each gateway is still fair among its own waiting tenants), logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources

import redis

from engine.priority import Priority
from services.router.redis_client import REDIS_DOWN_ERRORS

log = logging.getLogger(__name__)

# How far (relative) above the least-served backlogged tenant a tenant may get before it
# is held back: small enough for a tight share, large enough not to flap every tick.
SLACK = 0.05


@dataclass(frozen=True)
class TenantService:
    attained: float  # decayed weight-normalised KV-block-seconds
    backlogged: bool  # some gateway replica has it waiting


@dataclass(frozen=True)
class FairView:
    """The ledger at one tick: class -> tenant -> service."""

    classes: Mapping[Priority, Mapping[str, TenantService]] = field(default_factory=dict)

    def over_share(self, priority: Priority, tenant: str) -> bool:
        tenants = self.classes.get(priority, {})
        others = [s.attained for t, s in tenants.items() if s.backlogged and t != tenant]
        own = tenants.get(tenant)
        if not others or own is None:
            return False
        floor = min(others)
        return own.attained > floor * (1 + SLACK) + 1e-9

    def fairness_index(self, priority: Priority) -> float:
        """Jain's index of the backlogged tenants' normalised service (1.0: equal)."""
        xs = [s.attained for s in self.classes.get(priority, {}).values() if s.backlogged]
        square_sum = sum(x * x for x in xs)
        return (sum(xs) ** 2) / (len(xs) * square_sum) if square_sum > 0 else 1.0


Charges = Mapping[Priority, Mapping[str, float]]
Backlog = Mapping[Priority, list[str]]


class FairShare:
    """Thread-safe; `sync` runs in a worker thread (redis-py is synchronous)."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        half_life_s: float = 30.0,
        backlog_ttl_s: float = 2.0,
    ) -> None:
        if min(half_life_s, backlog_ttl_s) <= 0:
            raise ValueError("half_life_s and backlog_ttl_s must be > 0")
        self.client = client
        self.namespace = namespace
        self.half_life_ms = round(half_life_s * 1000)
        self.backlog_ttl_ms = round(backlog_ttl_s * 1000)
        text = (
            resources.files("services.gateway.flow").joinpath("fair_share.lua").read_text("utf-8")
        )
        self._script = client.register_script(text)
        self._lock = threading.Lock()
        self._down = False

    def keys(self) -> list[str]:
        out = []
        for p in sorted(Priority):
            out += [f"{self.namespace}:fair:{p.label}", f"{self.namespace}:fairq:{p.label}"]
        return out

    def sync(self, charges: Charges, backlog: Backlog) -> FairView:
        args: list[str | int | float] = [self.half_life_ms, self.backlog_ttl_ms, len(Priority)]
        for p in sorted(Priority):
            spent = charges.get(p, {})
            args.append(len(spent))
            for tenant, amount in spent.items():
                args += [tenant, repr(float(amount))]
            waiting = backlog.get(p, [])
            args += [len(waiting), *waiting]
        try:
            rows = self._script(keys=self.keys(), args=args)
        except REDIS_DOWN_ERRORS as exc:
            self._set_down(True, exc)
            return FairView()
        self._set_down(False, None)
        return FairView({p: _parse(rows[i]) for i, p in enumerate(sorted(Priority))})

    def _set_down(self, down: bool, exc: Exception | None) -> None:
        with self._lock:
            changed, self._down = self._down != down, down
        if changed and down:
            log.warning("Redis unreachable (%s): fair shares fail open until it returns", exc)
        elif changed:
            log.warning("Redis reachable again: fair shares resume")


def _parse(flat: list[object]) -> dict[str, TenantService]:
    out = {}
    for i in range(0, len(flat), 3):
        out[str(flat[i])] = TenantService(float(str(flat[i + 1])), int(str(flat[i + 2])) == 1)
    return out
