"""The router's core: turn a prompt into a (prefill, decode) or mixed placement.

Lifecycle of a decision (`Router.route`, synchronous and thread-safe):
1. Membership: every `membership_refresh_s` the router re-reads the registry (and the
   epoch key that tells it whether Redis lost its data) and rebuilds the ring of any pool
   whose non-draining members changed.
2. Key: the engine's prefix hash of the prompt's first K blocks, seeded with the cluster's
   model fingerprint and the tenant as salt; with it, the chained hashes of the first
   `match_blocks` blocks, which the placement looks up in the caches workers report.
3. Pools: prefill + decode if both have workers, else mixed, else a lone decode pool
   (it serves whole requests). Each pool's candidate order
   comes from the policy (the ring walk for the hashing policies), minus `exclude`.
4. Place: one pipelined round trip runs `bounded_load.lua` once per pool; each call is
   atomic, so the bound holds across any number of router replicas.
5. Release: `release(lease_ids)` gives the load back; leases also expire after `load_ttl_s`.
   A release Redis does not get (a slow reply, an outage) is kept and sent again with the
   next call that reaches it (`ReleaseBacklog`).

`route_decode` is the same decision over the decode (or mixed) pool alone: the gateway
asks for it when a request's prefill is done but its decode worker refused it.

Marked down: `report_down(worker_id)` (the gateway, after a call to the worker failed
UNAVAILABLE) stamps the worker's registration with `down_until`, which the placement
script honours on every router at once, long before the worker's heartbeat lease would
lapse; a restarted worker's registration clears it. Slow start: the script also ramps a
newly joined worker's share of the bound (`slow_start_s`; router.md).

Identity: a gateway's router checks the workers' published model identity against its
own copy (`expect_identity`, `IdentityCheck`) and refuses to place while they differ.

Fail-open: if Redis errors, the router places with `LocalLoad` on the last known
membership, logs once per outage, counts each such decision in `stats.fail_open`, and
tries Redis again after `redis_retry_s`. If Redis comes back empty (restarted), pools it
does not list yet keep their last membership, routed locally, for one heartbeat TTL, by
which time the workers' heartbeats have re-registered them.

Failover: each refresh also reads the primary's replication id; a new one (a Sentinel
promoted the replica) makes the router trim the load leases the new primary inherited to
the workers' own counts (`Failover`), once per pool across all routers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, replace

import redis

from engine.adapter_ref import AdapterRef
from engine.model_identity import IdentityPart, ModelIdentity
from services.common.role import Role
from services.router.failover import Failover, replication_id
from services.router.identity_check import IdentityCheck
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger, Placed, PlaceRequest, new_token
from services.router.local_load import LocalLoad
from services.router.membership import Membership, MembershipView
from services.router.placement import NoWorkerError, RouteDecision, RouteQuery, WorkerRef
from services.router.policies import make_policy
from services.router.prefix_key import prompt_key, tenant_seed
from services.router.redis_client import REDIS_DOWN_ERRORS
from services.router.registry import Registry
from services.router.release_backlog import ReleaseBacklog
from services.router.router_config import RouterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterStats:
    decisions: int = 0  # successful route() calls
    fail_open: int = 0  # pool placements made locally because Redis was unusable
    overflow: int = 0  # bounded placements that skipped the key's first worker
    redis_errors: int = 0  # Redis calls that failed with a connection/timeout error
    release_failures: int = 0  # lease releases Redis did not get at once (kept, sent again)
    owed_releases: int = 0  # a gauge: kept releases not sent yet (`ReleaseBacklog`)
    marked_down: int = 0  # workers reported down (`report_down`)
    failovers: int = 0  # new Redis primaries seen (`Failover`)
    reconciled_leases: int = 0  # inherited load leases this router trimmed after one
    # Leading prompt blocks the picks held (reported, or modelled for workers that do not
    # report), and the most any candidate held: their ratio is the placements' hit rate
    # against the one reachable (the gap is what the load bound and ties cost).
    prefix_runs: int = 0
    prefix_best_runs: int = 0


def total(stats: Iterable[RouterStats]) -> RouterStats:
    """Several routers' counters added up (a gateway has one router per model)."""
    sums = [sum(column) for column in zip(*(astuple(s) for s in stats), strict=True)]
    return RouterStats(*sums) if sums else RouterStats()


@dataclass(frozen=True)
class Routed:
    decision: RouteDecision
    placements: tuple[Placed, ...]  # (prefill, decode) or (mixed,) as in the decision, or (decode,)
    fail_open: bool  # some pool was placed with local counts, not through Redis


class Router:
    """Placement against one Redis; one instance per router replica (or gateway)."""

    def __init__(
        self,
        client: redis.Redis,
        config: RouterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.keys = Keyspace(config.namespace)
        self.client = client
        self.registry = Registry(
            client,
            self.keys,
            ttl_s=config.heartbeat_ttl_s,
            model=config.model_fingerprint,
            layout=config.layout_fingerprint,
        )
        self.ledger = LoadLedger(client, self.keys)
        self.failover = Failover(client, self.keys, config.load_ttl_s, config.heartbeat_ttl_s)
        self.policy = make_policy(config.policy, config.seed)
        self.local = LocalLoad(clock)
        self.backlog = ReleaseBacklog()
        self.membership = Membership(config.virtual_nodes, config.heartbeat_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._stats = RouterStats()
        self._next_refresh = float("-inf")
        self._redis_down_until = float("-inf")
        self._redis_down = False
        self._down: dict[str, float] = {}  # worker id -> until (clock): the local breaker
        self._identity: IdentityCheck | None = None

    # -- public API -------------------------------------------------------------------

    @property
    def stats(self) -> RouterStats:
        with self._lock:
            return replace(self._stats, owed_releases=len(self.backlog))

    @property
    def fail_open_count(self) -> int:
        return self.stats.fail_open

    def workers(self) -> list[WorkerRef]:
        """Every worker last known to be registered, draining ones included."""
        self._maybe_refresh(self._clock())
        return self.membership.view().refs()

    def expect_identity(
        self, identity: ModelIdentity, parts: Sequence[IdentityPart], who: str
    ) -> None:
        """From now on, refuse to place (ModelMismatchError) while the registered workers'
        model differs from `identity` in any of `parts`; `who` names the caller."""
        self._identity = IdentityCheck(identity, parts, who)

    def refresh(self) -> bool:
        """Re-read the registry now; False (and fail-open) if Redis is unreachable."""
        return self._maybe_refresh(self._clock(), force=True)

    def route(self, query: RouteQuery) -> RouteDecision:
        """Place one request; raises NoWorkerError if a pool has no eligible worker.
        A request of a LoRA adapter is keyed with the adapter's digest, and workers
        holding the adapter come first in each pool's ring walk
        (`MembershipView.holders_first`)."""
        return self.route_detailed(query).decision

    def route_decode(self, query: RouteQuery) -> RouteDecision:
        """Place the decode (or mixed) pool alone, for a request already prefilled on
        `query.prefill` (named in the decision, no load taken there); raises
        NoWorkerError."""
        routed = self.route_detailed(query, decode_only=True)
        return replace(routed.decision, prefill=query.prefill)

    def route_detailed(self, query: RouteQuery, *, decode_only: bool = False) -> Routed:
        """`route`, plus each pool's placement (load, bound, rank) for spans and tests;
        `decode_only` places the decode (or mixed) pool alone."""
        now = self._clock()
        self._maybe_refresh(now)
        view = self.membership.view()
        if self._identity is not None:
            self._identity.check(view)
        excluded = frozenset(query.exclude)
        where = _Where(query.prompt_token_ids, query.tenant, excluded, decode_only, query.adapter)
        placed = self._place(view, where, now)
        if any(p is None for p in placed) and now >= self._redis_down_until:
            # The view may be stale (a worker died or began draining): re-read and retry once.
            self.release([p.lease_id for p in placed if p is not None])
            self._maybe_refresh(now, force=True)
            view = self.membership.view()
            placed = self._place(view, where, now)
        roles = _pools(view, decode_only)
        if not roles:
            if self._redis_down:
                raise NoWorkerError(
                    "the router cannot reach Redis and knows no workers yet; check redis_url"
                )
            raise NoWorkerError(view.why_empty())
        missing = [r for r, p in zip(roles, placed, strict=True) if p is None]
        if missing:
            self.release([p.lease_id for p in placed if p is not None])
            raise NoWorkerError(view.why_none(missing[0], excluded))
        chosen = [p for p in placed if p is not None]
        self._count(decisions=1, overflow=sum(1 for p in chosen if p.rank > 0),
                    prefix_runs=sum(p.run for p in chosen),
                    prefix_best_runs=sum(p.best_run for p in chosen))  # fmt: skip
        refs = [view.ref(r, p.worker_id) for r, p in zip(roles, chosen, strict=True)]
        leases = [p.lease_id for p in chosen]
        prefill = refs[0] if len(refs) == 2 else None
        cached = self._cached_tokens(len(query.prompt_token_ids), chosen[-1].run)
        decision = RouteDecision(
            prefill, refs[-1], tuple(leases[:-1]), tuple(leases[-1:]), decode_cached_tokens=cached
        )
        return Routed(decision, tuple(chosen), any(p.local for p in chosen))

    def report_down(self, worker_id: str) -> None:
        """A call to `worker_id` failed UNAVAILABLE (refused, reset): every router sharing
        this Redis skips it for `down_s` (the registration's mark, read by the placement
        script), this one also while Redis is unreachable. Never raises on a dead Redis."""
        seconds = self.config.down_s
        if seconds <= 0:
            return
        now = self._clock()
        with self._lock:
            self._down[worker_id] = now + seconds
        self._count(marked_down=1)
        if now < self._redis_down_until:
            return
        try:
            self.registry.mark_down(worker_id, seconds)
        except REDIS_DOWN_ERRORS as exc:
            self._redis_failed(exc)

    def _up(self, order: list[str], now: float) -> list[str]:
        """`order` without the workers this router saw fail lately (all of it if that
        leaves none: trying a suspect beats placing nowhere)."""
        with self._lock:
            self._down = {w: until for w, until in self._down.items() if until > now}
            down = set(self._down)
        kept = [w for w in order if w not in down]
        return kept or order

    def release(self, lease_ids: Sequence[str]) -> None:
        """Give back load leases (local ones here, the rest in Redis). Never raises on a
        dead Redis: the leases it did not get are kept (`backlog`) and sent again with
        the next release or registry read that reaches it; they expire after
        `load_ttl_s` in any case."""
        remote = [lease for lease in lease_ids if not self.local.release(lease)]
        if not remote:
            return
        if self._clock() < self._redis_down_until:
            self._owe(remote)
            return
        self._send_releases(remote)

    # -- internals --------------------------------------------------------------------

    def _cached_tokens(self, prompt_tokens: int, run: int) -> int:
        """What the pick's run of leading blocks vouches for, never the last token
        (always computed); 0 for no run."""
        if run <= 0:
            return 0
        return max(0, min(run * self.config.block_size, prompt_tokens - 1))

    def _send_releases(self, fresh: Sequence[str]) -> None:
        owed = self.backlog.take()
        try:
            self.ledger.release([*owed, *fresh])
        except REDIS_DOWN_ERRORS as exc:
            self._redis_failed(exc)
            self.backlog.add(owed)
            self._owe(fresh)

    def _owe(self, lease_ids: Sequence[str]) -> None:
        self.backlog.add(lease_ids)
        self._count(release_failures=len(lease_ids))

    def _place(self, view: MembershipView, where: _Where, now: float) -> list[Placed | None]:
        """One placement per serving pool of `view` (None where no worker is eligible)."""
        cfg = self.config
        roles = _pools(view, where.decode_only)
        if not roles:
            return [None]
        prompt_token_ids = where.prompt
        adapter = where.adapter
        digest = "" if adapter is None else adapter.digest
        seed = tenant_seed(cfg.model_fingerprint or view.model, where.tenant, digest)
        pk = prompt_key(prompt_token_ids, cfg.block_size, cfg.prefix_blocks, cfg.match_blocks, seed)
        orders = {}
        for role in roles:
            ring = view.ring(role)
            walk = [w for w in self.policy.order(pk.key, ring) if w not in where.excluded]
            orders[role] = walk if adapter is None else view.holders_first(role, walk, adapter.name)
        redis_up = now >= self._redis_down_until
        remote = [r for r in roles if redis_up and not view.is_local_only([r])]
        out: dict[str, Placed | None] = {}
        if remote:
            weight = len(prompt_token_ids) // cfg.block_size
            reqs = [
                PlaceRequest(r, orders[r], self.policy.mode, cfg.eps, cfg.load_ttl_s, pk.key,
                             weight, cfg.cache_share, cfg.slow_start_s, pk.key_blocks, pk.blocks)
                for r in remote
            ]  # fmt: skip
            try:
                out.update(zip(remote, self.ledger.place_many(reqs), strict=True))
                self._redis_ok()
            except REDIS_DOWN_ERRORS as exc:
                self._redis_failed(exc)
        for role in roles:
            if role not in out:
                live = view.live(role, self._up(orders[role], now))
                out[role] = self.local.place(role, live, self.policy.mode, cfg.eps, cfg.load_ttl_s)
                self._count(fail_open=1)
        return [out[r] for r in roles]

    def _maybe_refresh(self, now: float, force: bool = False) -> bool:
        if not force and (now < self._next_refresh or now < self._redis_down_until):
            return not self._redis_down
        with self._refresh_lock:
            if not force and now < self._next_refresh:
                return True
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.setnx(self.keys.epoch, new_token())
                pipe.get(self.keys.epoch)
                pipe.info("replication")
                _, epoch, replication = pipe.execute(raise_on_error=False)
                if isinstance(epoch, Exception):
                    raise epoch
                workers = self.registry.list()
                self._follow_primary(replication_id(replication))
            except REDIS_DOWN_ERRORS as exc:
                self._redis_failed(exc)
                return False
            self._redis_ok()
            if len(self.backlog):
                self._send_releases(())
            self.membership.update(workers, str(epoch), now)
            self._next_refresh = now + self.config.membership_refresh_s
            return True

    def _follow_primary(self, replid: str) -> None:
        """Notice a new primary; run the load reconcile it owes (`Failover`)."""
        if self.failover.observe(replid):
            self._count(failovers=1)
            log.warning("Redis has a new primary (%s): reconciling load leases", replid)
        if not self.failover.owed:
            return
        try:
            done = self.failover.reconcile([r.value for r in Role])
        except redis.ResponseError as exc:  # a script error: try at the next refresh
            log.warning("load reconcile after a failover failed (%s); will retry", exc)
            return
        self._count(reconciled_leases=sum(r.trimmed for r in done))

    def _redis_failed(self, exc: Exception) -> None:
        with self._lock:
            self._stats = _bump(self._stats, redis_errors=1)
            first = not self._redis_down
            self._redis_down = True
            self._redis_down_until = self._clock() + self.config.redis_retry_s
        if first:
            log.warning(
                "Redis unreachable (%s): routing fails open on the last known %d workers with "
                "local load counts until it returns",
                exc,
                len(self.membership.view().refs()),
            )

    def _redis_ok(self) -> None:
        with self._lock:
            recovered = self._redis_down
            self._redis_down = False
        if recovered:
            log.warning("Redis reachable again: routing through Redis resumes")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._stats = _bump(self._stats, **deltas)


@dataclass(frozen=True)
class _Where:
    """What one placement is for: the prompt, its tenant and adapter, and where not."""

    prompt: Sequence[int]
    tenant: str
    excluded: frozenset[str]
    decode_only: bool
    adapter: AdapterRef | None


def _pools(view: MembershipView, decode_only: bool) -> tuple[str, ...]:
    """The pools a decision places: every serving one, or the last (decode, or mixed)."""
    roles = view.serving_roles()
    return roles[-1:] if decode_only else roles


def _bump(stats: RouterStats, **deltas: int) -> RouterStats:
    values = {k: getattr(stats, k) + v for k, v in deltas.items()}
    return RouterStats(**{**stats.__dict__, **values})
