"""Load leases in Redis: the atomic bounded-load placement, release and expiry.

Lifecycle of one load lease: `LoadLedger.place` runs `bounded_load.lua`, which purges
expired leases, picks a worker from the candidate order, and records a lease (member of
`ns:load:<role>` scored by its expiry in Redis server time, plus +1 in `ns:count:<role>`)
in one atomic call. The caller hands the lease id back through `release` (`release_load.lua`
removes it and decrements); if the holder dies instead, the next placement or snapshot
after the TTL purges it and adds it to `ns:expired:<role>`, so a lease that was never
released stays visible to a leak check after it is gone. Counts and the ZSET change
only inside scripts, so they agree.

Mode `cache_aware` (policy `bounded`, the default) prefers, below the bound, the worker
holding the longest run of the prompt's leading blocks, so a hot prefix spreads over
workers that already cache it instead of spilling to the next ring worker, which would
evict that worker's own prefixes. A worker's run comes from the block hashes it reports
(`residency.py`: what its pool and offload tier really hold), or, for a worker that does
not report, from the router's model of its cache: the prefix keys placed there,
LRU-evicted at the worker's registered KV capacity x `cache_share`. Prompts nobody holds
follow the ring walk as in `bounded`.

`choose` is the same selection in Python: the router's fail-open path uses it on local
counts (without cache models: cache_aware acts as bounded there), and the tests use it
as the oracle for the script.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import redis

from services.router.keyspace import Keyspace, parse_lease_id
from services.router.residency import hash_text

MODES = ("cache_aware", "bounded", "first", "least", "round_robin")
# A departed worker's cache model is dropped after this long without a placement.
CACHE_MODEL_TTL_MS = 3_600_000


@dataclass(frozen=True)
class Placed:
    """One pool's placement: the lease taken and what the choice was based on."""

    worker_id: str
    lease_id: str
    load: int  # the worker's load just before this placement
    bound: int  # ceil((1 + eps) * (total + 1) / n) at that moment
    n: int  # counted candidates (live, not draining, not excluded)
    total: int  # their summed load before this placement
    rank: int  # index of the worker among counted candidates; > 0 means overflow
    local: bool = False  # placed by this process's fail-open counts, not through Redis
    run: int = 0  # leading prompt blocks the pick held, reported or modelled (cache_aware)
    best_run: int = 0  # the longest such run any counted candidate held, bound or not

    @property
    def warm(self) -> bool:
        """The pick held some of the prompt's prefix."""
        return self.run > 0


@dataclass(frozen=True)
class PlaceRequest:
    role: str
    candidates: Sequence[str]  # preference order; the script drops dead and draining ones
    mode: str
    eps: float
    ttl_s: float
    key: int = 0  # the request's prefix key (cache_aware)
    weight: int = 0  # full KV blocks of its prompt: its footprint in a prefix cache
    cache_share: float = 1.0  # share of a worker's KV capacity the cache model assumes
    slow_start_s: float = 0.0  # a worker that joined this recently takes a ramped share
    key_blocks: int = 1  # blocks the key stands for: a modelled hit's run (cache_aware)
    blocks: Sequence[int] = ()  # the prompt's leading block hashes, looked up in reports


@dataclass(frozen=True)
class LoadSnapshot:
    leases: int  # live leases in the pool's ZSET
    counts: dict[str, int]  # worker id -> live leases (workers with none are absent)
    expired: int = 0  # leases ever purged because they expired unreleased (never reset)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def load_bound(total: int, n: int, eps: float) -> int:
    """The bounded-load cap, computed exactly as `bounded_load.lua` does (IEEE doubles)."""
    return math.ceil((1 + eps) * (total + 1) / n)


def choose(
    mode: str, loads: Sequence[int], eps: float, rr_counter: int = 0, runs: Sequence[int] = ()
) -> tuple[int, int, int]:
    """(index, bound, total) of the pick among counted candidates with `loads`, in order.

    Precondition: `loads` is non-empty. `rr_counter` is the round-robin counter after
    incrementing (1-based), as the script's INCR returns it. `runs[i]` is how many of the
    prompt's leading blocks candidate i holds (cache_aware; none if empty).
    """
    n = len(loads)
    total = sum(loads)
    bound = load_bound(total, n, eps)
    under = [i for i, load in enumerate(loads) if load < bound]
    warm_under = [i for i in under if mode == "cache_aware" and i < len(runs) and runs[i] > 0]
    if warm_under:
        pick = min(warm_under, key=lambda i: (-runs[i], loads[i], i))
    elif mode in ("bounded", "cache_aware"):
        pick = under[0]
    elif mode == "least":
        pick = min(range(n), key=lambda i: (loads[i], i))
    elif mode == "round_robin":
        pick = (rr_counter - 1) % n
    elif mode == "first":
        pick = 0
    else:
        raise ValueError(f"unknown placement mode {mode!r}; expected one of {MODES}")
    return pick, bound, total


def _script_text(name: str) -> str:
    return resources.files("services.router").joinpath(name).read_text(encoding="utf-8")


def new_token() -> str:
    return uuid.uuid4().hex


class LoadLedger:
    """Load leases of every pool of one cluster, in one Redis.

    Precondition: `client` decodes responses (see `redis_client.connect`). Methods raise
    redis errors as they come; the router decides what a dead Redis means.
    """

    def __init__(self, client: redis.Redis, keys: Keyspace, *, purge_batch: int = 1000) -> None:
        self.client = client
        self.keys = keys
        self.purge_batch = purge_batch
        self._place = client.register_script(_script_text("bounded_load.lua"))
        self._release = client.register_script(_script_text("release_load.lua"))
        self._snapshot = client.register_script(_script_text("load_snapshot.lua"))

    def place(self, req: PlaceRequest) -> Placed | None:
        """Place in one pool (one round trip); None if no candidate is live."""
        return self.place_many([req])[0]

    def place_many(self, reqs: Sequence[PlaceRequest]) -> list[Placed | None]:
        """Place in several pools in one pipelined round trip; each pool is atomic."""
        calls = [self._place_call(r) for r in reqs]
        pipe = self.client.pipeline(transaction=False)
        for keys, args, _ in calls:
            # Raw EVALSHA, not Script.__call__: a pipeline with registered scripts sends
            # SCRIPT EXISTS first, a second round trip on every decision.
            pipe.evalsha(self._place.sha, len(keys), *keys, *args)
        results = pipe.execute(raise_on_error=False)
        out: list[Placed | None] = []
        error: Exception | None = None
        for (keys, args, lease_prefix), res in zip(calls, results, strict=True):
            if isinstance(res, redis.exceptions.NoScriptError):
                try:
                    res = self._place(keys=keys, args=args)  # loads the script, runs it
                except redis.RedisError as exc:
                    res = exc
            if isinstance(res, Exception):
                error = error or res
                out.append(None)
            else:
                out.append(_placed(res, lease_prefix))
        if error is not None:
            # All or nothing: give back what the other pools took before raising.
            self.release([p.lease_id for p in out if p is not None])
            raise error
        return out

    def _place_call(self, r: PlaceRequest) -> tuple[list[str], list[str | int], str]:
        if r.mode not in MODES:
            raise ValueError(f"unknown placement mode {r.mode!r}; expected one of {MODES}")
        lease_prefix = f"{r.role}:{new_token()}:"
        keys = [self.keys.load(r.role), self.keys.count(r.role), self.keys.round_robin(r.role)]
        keys += [self.keys.cache_seq(r.role), self.keys.expired(r.role)]
        keys += [self.keys.worker(w) for w in r.candidates]
        if r.mode == "cache_aware":
            keys += [self.keys.cache_lru(r.role, w) for w in r.candidates]
            keys += [self.keys.cache_weights(r.role, w) for w in r.candidates]
            keys += [self.keys.resident(w) for w in r.candidates]
        ttl_ms = max(1, round(r.ttl_s * 1000))
        args: list[str | int] = [r.mode, repr(float(r.eps)), lease_prefix, ttl_ms]
        args += [self.purge_batch, hash_text(r.key), r.weight]
        args += [repr(float(r.cache_share)), CACHE_MODEL_TTL_MS]
        args += [max(0, round(r.slow_start_s * 1000)), max(1, r.key_blocks)]
        blocks = [hash_text(b) for b in r.blocks] if r.mode == "cache_aware" else []
        args += [len(blocks), *blocks, *r.candidates]
        return keys, args, lease_prefix

    def release(self, lease_ids: Sequence[str]) -> int:
        """Release leases (any pools; one round trip); returns how many were still live."""
        by_role: dict[str, list[str]] = {}
        for lease in lease_ids:
            by_role.setdefault(parse_lease_id(lease)[0], []).append(lease)
        if not by_role:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for role, leases in by_role.items():
            keys = [self.keys.load(role), self.keys.count(role)]
            pipe.evalsha(self._release.sha, len(keys), *keys, *leases)
        results = pipe.execute(raise_on_error=False)
        released = 0
        for (role, leases), res in zip(by_role.items(), results, strict=True):
            if isinstance(res, redis.exceptions.NoScriptError):
                res = self._release(keys=[self.keys.load(role), self.keys.count(role)], args=leases)
            elif isinstance(res, Exception):
                raise res
            released += int(res)
        return released

    def snapshot(self, role: str) -> LoadSnapshot:
        """Purge all expired leases of a pool, then read its live leases, counts and how
        many leases have ever expired unreleased."""
        keys = [self.keys.load(role), self.keys.count(role), self.keys.expired(role)]
        res = self._snapshot(keys=keys)
        flat = [str(x) for x in res[2:]]
        counts = {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}
        return LoadSnapshot(int(res[0]), counts, int(res[1]))


def _placed(res: list[object], lease_prefix: str) -> Placed | None:
    worker = str(res[0])
    if not worker:
        return None
    load, bound, n, total, rank, run, best_run = (int(str(x)) for x in res[1:8])
    return Placed(worker, lease_prefix + worker, load, bound, n, total, rank,
                  run=run, best_run=best_run)  # fmt: skip
