"""Placement policies: how a request's key becomes a candidate order and a pick rule.

Every policy reduces to (candidate order, mode). The order is computed here, client-side,
from the pool's ring; the mode is the pick rule `bounded_load.lua` (or, failing open,
`LocalLoad`) applies to that order's live workers, atomically with taking a load lease.
So all policies lease load the same way, and comparing them compares only the choice:

- bounded       ring walk from the key; below the load bound, the least-loaded worker the
                router's cache model says holds the key, else the first on the walk (default)
- bounded_ring  ring walk; first worker below the load bound (the textbook rule)
- consistent    ring walk; first live worker (pure affinity, unbounded)
- round_robin   workers by id; the pool's shared counter picks (across all routers)
- least_loaded  ring walk; the least-loaded worker, ties to the one nearest the key
- random        a uniformly shuffled order; first live worker
"""

from __future__ import annotations

import random
from typing import Protocol

from services.router.ring import HashRing


class Policy(Protocol):
    name: str
    mode: str  # a `load.MODES` pick rule

    def order(self, key: int, ring: HashRing) -> list[str]:
        """Candidate worker ids, most preferred first. No side effects."""
        ...


class _RingWalk:
    """Candidates in ring order from the key: the affinity order of the hashing policies."""

    name = ""
    mode = ""

    def order(self, key: int, ring: HashRing) -> list[str]:
        return list(ring.walk(key))


class BoundedLoadPolicy(_RingWalk):
    name = "bounded"
    mode = "cache_aware"


class BoundedRingPolicy(_RingWalk):
    name = "bounded_ring"
    mode = "bounded"


class ConsistentHashPolicy(_RingWalk):
    name = "consistent"
    mode = "first"


class RoundRobinPolicy:
    name = "round_robin"
    mode = "round_robin"

    def order(self, key: int, ring: HashRing) -> list[str]:
        return sorted(ring.members)


class LeastLoadedPolicy(_RingWalk):
    name = "least_loaded"
    mode = "least"


class RandomPolicy:
    name = "random"
    mode = "first"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def order(self, key: int, ring: HashRing) -> list[str]:
        members = sorted(ring.members)
        self._rng.shuffle(members)
        return members


def make_policy(name: str, seed: int | None = None) -> Policy:
    """The policy called `name` (see `RouterConfig.policy`)."""
    if name == "random":
        return RandomPolicy(seed)
    simple: dict[str, type[Policy]] = {
        "bounded": BoundedLoadPolicy,
        "bounded_ring": BoundedRingPolicy,
        "consistent": ConsistentHashPolicy,
        "round_robin": RoundRobinPolicy,
        "least_loaded": LeastLoadedPolicy,
    }
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; expected one of {[*simple, 'random']}")
    return simple[name]()
