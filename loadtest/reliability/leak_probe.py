"""The cluster leak probe: what ended requests still hold, and which leases ended by
expiry instead of a release.

Lifecycle: `await LeakProbe.start(target)` takes a baseline when a test (or the soak)
starts: every worker's count of KV leases ended by expiry, every pool's count of load
leases Redis purged as expired (`ns:expired:<role>`), and the tokens charged to every
tenant's quota windows. The test runs. `await probe.wait_clean()` then reads the cluster
until nothing is held or `wait_s` has passed. `wait_s` is at most half the shortest lease
TTL, so a lease the code never released is still live when the wait gives up; one that
expired before (or during) the wait is counted by its expiry counter. Every lease ended
by expiry since the baseline is a leak; a test whose fault leaves a lease to expire by
design says how many with `allow_expired_kv` / `allow_expired_load`.

What a request can hold, and where the probe reads it:
- a worker (its Stats RPC): KV blocks (`used_blocks` counts running, held for export and
  importing requests), held blocks, running and waiting requests, active KV leases, and
  KV leases ended by expiry since the baseline;
- Redis: live load leases per pool, load leases purged as expired since the baseline,
  and (given `quota_used`) tokens charged to each tenant, which must equal tokens used;
- the gateway (its Prometheus page): `pdserve_gateway_held{resource}` for every resource
  of a request record (`HELD_RESOURCES`), the stream slots in use
  (`pdserve_active_streams`) and the router's releases still owed to Redis. The gauge
  family must be there whenever the gateway serves metrics: a probe that cannot see a
  resource reports it as missing, never as clean.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
import redis

from kvtransfer.config import TransferConfig
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import family_samples, scrape
from services.common.role import Role
from services.common.tls import TlsConfig, open_aio_channel
from services.gateway.stream.record_book import GAUGE, Resource
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger
from services.router.redis_client import connect
from services.router.registry import Registry
from services.router.router_config import RouterConfig

#: WorkerStats counters that must all be zero on an idle worker.
WORKER_HELD = (
    "used_blocks", "held_blocks", "running", "waiting", "active_leases", "lora_held",
)  # fmt: skip
#: What one gateway request record can hold (labels of `pdserve_gateway_held`): read
#: from the gateway's own enum, so a resource added there is checked here too.
HELD_RESOURCES = tuple(resource.value for resource in Resource)
HELD_GAUGE = GAUGE
#: Other gateway gauges that must read 0 when no request is in flight.
GATEWAY_IDLE = ("pdserve_active_streams", "pdserve_router_owed_releases")
ROLES = tuple(role.value for role in Role)


@dataclass(frozen=True)
class WorkerRef:
    name: str
    address: str
    incarnation: str  # changes when the process is replaced: its counters restart at 0


@dataclass(frozen=True)
class LeaseTtls:
    kv_s: float  # exported KV on prefill workers
    load_s: float | None  # load leases in Redis; None when nothing is placed through Redis

    @classmethod
    def of(cls, cfg: ClusterConfig) -> LeaseTtls:
        """The TTLs a cluster runs with: its overrides, else each service's default."""
        kv = cfg.kv_lease_ttl_s or TransferConfig().kv_lease_ttl_s
        load = cfg.load_ttl_s or RouterConfig().load_ttl_s
        return cls(kv, load if cfg.placement == "redis" else None)

    @property
    def wait_bound_s(self) -> float:
        """The longest the probe waits: half the shortest TTL, so no lease the code left
        behind can expire, and pass for released, while the probe waits for it."""
        return 0.5 * min(t for t in (self.kv_s, self.load_s) if t is not None)


@dataclass(frozen=True)
class ProbeTarget:
    """Where the probe reads one cluster; `workers()` lists the live workers now."""

    workers: Callable[[], list[WorkerRef]]
    ttls: LeaseTtls
    redis_url: Callable[[], str | None] = lambda: None
    namespace: str = "pdserve"
    gateway_metrics_ports: tuple[int, ...] = ()  # every gateway replica's /metrics
    tls: TlsConfig = field(default_factory=TlsConfig)

    @classmethod
    def local(cls, cluster: LocalCluster) -> ProbeTarget:
        """A `LocalCluster`: its live worker processes (a relaunch is a new incarnation)."""

        def workers() -> list[WorkerRef]:
            return [WorkerRef(c.name, c.address, str(c.proc.pid)) for c in cluster.workers
                    if c.proc.poll() is None]  # fmt: skip

        def redis_url() -> str | None:  # a restarted Redis comes back on the same port
            return cluster.redis.url if cluster.redis else None

        ports = tuple(g.metrics_port for g in cluster.gateways if g.metrics_port is not None)
        return cls(workers, LeaseTtls.of(cluster.cfg), redis_url, gateway_metrics_ports=ports,
                   tls=cluster.tls)  # fmt: skip

    @classmethod
    def registry(cls, redis_url: str, namespace: str, ttls: LeaseTtls) -> ProbeTarget:
        """Any deployment with Redis placement: the workers registered there now (a new
        address is a new incarnation), e.g. a Ray cluster."""

        def workers() -> list[WorkerRef]:
            client = connect(redis_url, 2.0)
            try:
                infos = Registry(client, Keyspace(namespace)).list()
            finally:
                client.close()
            return [WorkerRef(w.worker_id, w.address, w.address) for w in infos]

        return cls(workers, ttls, lambda: redis_url, namespace)


@dataclass(frozen=True)
class Baseline:
    expired_kv: dict[tuple[str, str], int]  # (worker, incarnation) -> KV leases expired
    expired_load: dict[str, int]  # pool -> load leases ever purged as expired
    quota: dict[str, int]  # quota window key -> tokens charged


@dataclass(frozen=True)
class Leaks:
    """One reading; every dict holds only non-zero entries."""

    workers: dict[str, dict[str, int]]  # worker -> its held counters
    load: dict[str, int]  # pool -> live load leases in Redis
    expired_kv: dict[str, int]  # worker -> KV leases ended by expiry since the baseline
    expired_load: dict[str, int]  # pool -> load leases purged as expired since then
    gateway: dict[str, float]  # held resource or idle gauge -> its value
    quota: dict[str, int]  # tenant -> tokens charged minus tokens used
    missing: list[str] = field(default_factory=list)  # what the probe could not read
    allow_expired_kv: int = 0
    allow_expired_load: int = 0

    @property
    def over_expired(self) -> bool:
        return (sum(self.expired_kv.values()) > self.allow_expired_kv
                or sum(self.expired_load.values()) > self.allow_expired_load)  # fmt: skip

    @property
    def clean(self) -> bool:
        held = self.workers or self.load or self.gateway or self.quota or self.missing
        return not held and not self.over_expired


async def worker_stats(
    address: str, tls: TlsConfig | None = None, timeout: float = 2.0
) -> worker_pb2.WorkerStats:
    async with open_aio_channel(address, tls or TlsConfig(), []) as channel:
        stats: worker_pb2.WorkerStats = await worker_pb2_grpc.WorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=timeout
        )
    return stats


def _redis_state(url: str, namespace: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(live load leases per pool role, leases ever purged as expired per pool role, tokens
    per quota window), the roles' counts summed over the base namespace and every model's
    and version's pool namespace under it (`<namespace>/<name>[@<version>]`). The
    snapshots purge expired leases first, so they are counted."""
    client = connect(url, 2.0)
    try:
        live, expired = dict.fromkeys(ROLES, 0), dict.fromkeys(ROLES, 0)
        for pool in _pool_namespaces(client, namespace):
            ledger = LoadLedger(client, Keyspace(pool))
            for role in ROLES:
                snap = ledger.snapshot(role)
                live[role] += snap.total
                expired[role] += snap.expired
        windows = list(client.scan_iter(match=f"{namespace}:quota:*", count=1000))
        values = client.mget(windows) if windows else []
        quota = {str(k): int(v) for k, v in zip(windows, values, strict=True) if v is not None}
        return live, expired, quota
    finally:
        client.close()


def _pool_namespaces(client: redis.Redis, namespace: str) -> set[str]:
    """`namespace` and each pool namespace under it that ever held a load lease."""
    pools = {namespace}
    for key in client.scan_iter(match=f"{namespace}/*", count=1000):
        for marker in (":count:", ":expired:", ":load:"):
            if marker in str(key):
                pools.add(str(key).split(marker, 1)[0])
    return pools


def _tenant(window_key: str, namespace: str) -> str:
    """`ns:quota:<tenant>:<window>` -> tenant."""
    return window_key.removeprefix(f"{namespace}:quota:").rsplit(":", 1)[0]


def _labels(sample: str, family: str) -> dict[str, str]:
    """Labels of a `scrape` key `family{a=b,c=d}`; empty if it is not of that family."""
    if not sample.startswith(family + "{"):
        return {}
    pairs = (p.partition("=") for p in sample[len(family) + 1 : -1].split(","))
    return {k: v for k, _, v in pairs}


def _gateway_page(port: int) -> tuple[dict[str, float], list[str]]:
    """Non-zero held resources and idle gauges of the gateway, and what is missing."""
    try:
        page = scrape(port)
    except OSError as exc:
        return {}, [f"gateway metrics on port {port}: {exc}"]
    held: dict[str, float] = {}
    missing: list[str] = []
    for resource in HELD_RESOURCES:
        samples = [v for k, v in page.items() if _labels(k, HELD_GAUGE).get("resource") == resource]
        if not samples:
            missing.append(f'{HELD_GAUGE}{{resource="{resource}"}}')
        elif sum(samples):
            held[resource] = sum(samples)
    # Each label set counts (the active streams are counted by model): one model's +1
    # and another's -1 are two faults, not a clean zero.
    idle = {name: sum(map(abs, family_samples(page, name))) for name in GATEWAY_IDLE}
    held.update({name: value for name, value in idle.items() if value})
    return held, missing


class LeakProbe:
    """Reads a cluster against the baseline it took when it started."""

    def __init__(self, target: ProbeTarget, baseline: Baseline) -> None:
        self.target = target
        self.baseline = baseline

    @classmethod
    async def start(cls, target: ProbeTarget) -> LeakProbe:
        """Take the baseline now. Raises if a live worker does not answer: a counter the
        probe could not read would hide every expiry that follows."""
        expired_kv = {}
        for w in target.workers():
            stats = await worker_stats(w.address, target.tls)
            expired_kv[(w.name, w.incarnation)] = stats.expired_leases
        url = target.redis_url()
        _, expired_load, quota = (
            await asyncio.to_thread(_redis_state, url, target.namespace) if url else ({}, {}, {})
        )
        return cls(target, Baseline(expired_kv, expired_load, quota))

    @property
    def wait_s(self) -> float:
        return self.target.ttls.wait_bound_s

    async def read(
        self,
        *,
        allow_expired_kv: int = 0,
        allow_expired_load: int = 0,
        quota_used: Mapping[str, int] | None = None,
    ) -> Leaks:
        """One reading. `quota_used` (tenant -> prompt + completion tokens of the requests
        it sent since the baseline): every tenant's charge must equal it (0 if absent)."""
        workers: dict[str, dict[str, int]] = {}
        expired_kv: dict[str, int] = {}
        missing: list[str] = []
        for w in self.target.workers():
            try:
                stats = await worker_stats(w.address, self.target.tls)
            except grpc.aio.AioRpcError as exc:
                missing.append(f"{w.name}: Stats {exc.code().name}")
                continue
            held = {f: int(getattr(stats, f)) for f in WORKER_HELD if getattr(stats, f)}
            if held:
                workers[w.name] = held
            base = self.baseline.expired_kv.get((w.name, w.incarnation), 0)
            if stats.expired_leases > base:
                expired_kv[w.name] = stats.expired_leases - base
        load, expired_load, quota = await self._redis(quota_used)
        gateway: dict[str, float] = {}
        for port in self.target.gateway_metrics_ports:  # summed: every count must be 0
            page, absent = await asyncio.to_thread(_gateway_page, port)
            for name, value in page.items():
                gateway[name] = gateway.get(name, 0.0) + value
            missing += absent
        return Leaks(workers, load, expired_kv, expired_load, gateway, quota, missing,
                     allow_expired_kv, allow_expired_load)  # fmt: skip

    async def _redis(
        self, quota_used: Mapping[str, int] | None
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        url = self.target.redis_url()
        if not url:
            return {}, {}, {}
        ns = self.target.namespace
        live, purged, windows = await asyncio.to_thread(_redis_state, url, ns)
        expired = {}
        for role, count in purged.items():
            base = self.baseline.expired_load.get(role, 0)
            # A counter below its baseline was lost with Redis's data: it counts from 0.
            if (delta := count - base if count >= base else count) > 0:
                expired[role] = delta
        quota: dict[str, int] = {}
        if quota_used is not None:
            charged: dict[str, int] = {}
            for key, tokens in windows.items():  # windows gone since were not charged
                tenant = _tenant(key, ns)
                charged[tenant] = charged.get(tenant, 0) + tokens - self.baseline.quota.get(key, 0)
            for tenant in charged.keys() | quota_used.keys():
                if diff := charged.get(tenant, 0) - quota_used.get(tenant, 0):
                    quota[tenant] = diff
        return {r: n for r, n in live.items() if n}, expired, quota

    async def wait_clean(
        self,
        timeout: float | None = None,
        *,
        allow_expired_kv: int = 0,
        allow_expired_load: int = 0,
        quota_used: Mapping[str, int] | None = None,
    ) -> Leaks:
        """Read until clean, until `min(timeout, wait_s)` has passed, or until more leases
        expired than allowed (that cannot heal); returns the last reading."""
        limit = self.wait_s if timeout is None else min(timeout, self.wait_s)
        end = time.monotonic() + limit
        while True:
            leaks = await self.read(
                allow_expired_kv=allow_expired_kv,
                allow_expired_load=allow_expired_load,
                quota_used=quota_used,
            )
            if leaks.clean or leaks.over_expired or time.monotonic() > end:
                return leaks
            await asyncio.sleep(0.1)
