"""Tenants' shares of the KV pool: which free cached block the pool gives up, and for whom.

Lifecycle: the block pool owns one `CacheShares`. Every block it hands out belongs to the
tenant of the request it was allocated for (`CacheOwner`; tenants never share a hash,
since the tenant's salt seeds the chain, engine/prefix_hash.py): `hold` counts it when it
is allocated, `release` when it goes back to the pool for good (freed without a hash, or
evicted). A hashed block that no request uses waits in its tenant's own
least-recently-freed list (`park`; `unpark` when a prefix hit takes it back). When the
pool must evict, `evict` takes the oldest parked block of the tenant that holds the most
blocks per unit of weight, in use or parked.

Why not one LRU list: a tenant sending distinct prompts (a crawl, a batch job) frees a
stream of blocks that nobody will hit again, and under plain LRU each pushes out the
least recently used block of anyone, so another tenant's hot system prompt goes as soon
as the flood has freed a pool's worth between two of that tenant's requests. Here the
flood evicts its own blocks once it holds more of the pool per weight than the other
tenant does. Admitting a new request is held to the same rule (`evictable`, `evict`
with `for_tenant`): it may evict only its own tenant's blocks and those of tenants
holding at least as much per weight as its own does when the allocation starts, so a
flood whose requests are all in flight waits for its own blocks rather than take a
lighter tenant's cached prefix. Growing a running request (a decode, the next chunk) may
evict anyone's: it must progress. With a single tenant (every request's cache salt the
same, the default) this is exactly least recently freed first, for everyone.

A tenant's weight is its fair share (the gateway's key `weight`, 1 by default); the
latest allocation for it sets it. Choosing a victim costs O(tenants with a parked block);
not thread-safe (the pool's owner, the engine's step thread, calls it).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheOwner:
    """Whose a cached block is: the tenant (the request's cache salt) and its weight."""

    tenant: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"cache weight must be > 0, got {self.weight}")


#: The owner of blocks published without a tenant (tests, single-tenant deployments).
NO_OWNER = CacheOwner()


@dataclass
class _Tenant:
    weight: float
    held: int = 0  # blocks it owns, in use or parked
    parked: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first

    @property
    def load(self) -> float:
        return self.held / self.weight


class CacheShares:
    """Pool blocks by tenant, and the parked (free, cached) ones in each tenant's LRU order."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._parked_by: dict[str, _Tenant] = {}  # tenants with at least one parked block
        self.num_parked = 0

    def hold(self, owner: CacheOwner) -> None:
        """`owner`'s tenant now holds one more block (weighed at `owner.weight`)."""
        tenant = self._tenants.get(owner.tenant)
        if tenant is None:
            tenant = self._tenants[owner.tenant] = _Tenant(owner.weight)
        tenant.weight = owner.weight
        tenant.held += 1

    def release(self, tenant: str) -> None:
        """`tenant` no longer holds one of its blocks (back in the pool for good)."""
        entry = self._tenants[tenant]
        entry.held -= 1
        if entry.held == 0:
            del self._tenants[tenant]

    def park(self, block_id: int, tenant: str) -> None:
        """A held block of `tenant` is free now: it may be evicted, newest last."""
        entry = self._tenants[tenant]
        entry.parked[block_id] = None
        self._parked_by[tenant] = entry
        self.num_parked += 1

    def unpark(self, block_id: int, tenant: str) -> None:
        """A parked block is in use again (a prefix hit): it may no longer be evicted."""
        entry = self._tenants[tenant]
        del entry.parked[block_id]
        self._unparked(tenant, entry)

    def evict(self, for_tenant: str | None = None, floor: float = 0.0) -> int:
        """Unpark and return the block to give up: the oldest parked block of the tenant
        with the most blocks per weight (ties: the tenant first parked in). For an
        admission (`for_tenant` set), only that tenant's blocks and those of tenants
        holding at least `floor` per weight (the requester's `load` when its allocation
        began) may go. The caller drops the block's hash and `release`s it. KeyError when
        nothing may go (check `evictable` first)."""
        candidates = [
            name for name, entry in self._parked_by.items()
            if for_tenant is None or name == for_tenant or entry.held >= floor * entry.weight
        ]  # fmt: skip
        if not candidates:
            raise KeyError("no parked block may be evicted")
        name = max(candidates, key=lambda t: self._parked_by[t].load)
        entry = self._parked_by[name]
        block_id, _ = entry.parked.popitem(last=False)
        self._unparked(name, entry)
        return block_id

    def evictable(self, for_tenant: str | None = None) -> int:
        """How many blocks `evict(for_tenant, load(for_tenant))` can give up in a row (each
        eviction lowers its tenant's holding; the floor stays)."""
        if for_tenant is None:
            return self.num_parked
        floor = self.load(for_tenant)
        count = 0
        for name, entry in self._parked_by.items():
            if name == for_tenant:
                count += len(entry.parked)
            elif entry.held >= floor * entry.weight:
                # Evicting j blocks keeps it at or above the floor while held - j >= floor * w.
                count += min(len(entry.parked), math.floor(entry.held - floor * entry.weight) + 1)
        return count

    @property
    def num_tenants(self) -> int:
        """Tenants holding at least one block."""
        return len(self._tenants)

    def load(self, tenant: str) -> float:
        """Blocks `tenant` holds per unit of its weight (0 for a tenant holding none)."""
        entry = self._tenants.get(tenant)
        return 0.0 if entry is None else entry.load

    def drain(self) -> Iterator[int]:
        """Unpark every parked block (the caller drops each one's hash)."""
        for name, entry in list(self._parked_by.items()):
            while entry.parked:
                block_id, _ = entry.parked.popitem(last=False)
                self._unparked(name, entry)
                yield block_id

    def parked(self) -> list[int]:
        """Every parked block id, tenant by tenant, oldest first (for checks)."""
        return [b for entry in self._parked_by.values() for b in entry.parked]

    def held(self, tenant: str) -> int:
        """Blocks `tenant` holds now, in use or parked."""
        entry = self._tenants.get(tenant)
        return 0 if entry is None else entry.held

    def _unparked(self, name: str, entry: _Tenant) -> None:
        self.num_parked -= 1
        if not entry.parked:
            del self._parked_by[name]
