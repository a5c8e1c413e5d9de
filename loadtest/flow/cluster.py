"""The cluster a flow-control benchmark drives: 1 prefill + 1 decode worker, Redis
placement, one or more gateways, and the benchmark's tenants in an API keys file.

Lifecycle: `with FlowCluster(cfg, settings, tenants, gateways=n) as fc:` writes a keys
file (one fresh key per tenant, with its default class, highest class and weight) into a
private temporary directory, starts a `LocalCluster` whose gateways all load it (and get
the run's admission flags), and on exit stops the cluster and deletes the file. Inside,
`warm_up` sends a few unmeasured requests through every gateway, and `start_leak_probes`
/ `check_leaks` run the leak probe (`loadtest.reliability.leak_probe`) over the workers,
Redis and every gateway replica (one probe, `ProbeTarget.local`, reads them all).
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from engine.config import EngineConfig
from engine.priority import Priority
from loadtest.flow.config import FlowBenchConfig
from loadtest.harness.settings import RunSettings
from loadtest.reliability.leak_probe import LeakProbe, Leaks, ProbeTarget
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request

#: Tokens per KV block on the workers (they run the engine's default).
BLOCK_SIZE = EngineConfig().block_size


@dataclass(frozen=True)
class Tenant:
    name: str
    default_class: Priority = Priority.STANDARD
    max_class: Priority = Priority.CRITICAL
    weight: float = 1.0

    def line(self, key: str) -> str:
        """Its line of the gateway's keys file (`services/gateway/access/auth.py`)."""
        return (f"{self.name} {key} class={self.default_class.label} "
                f"max_class={self.max_class.label} weight={self.weight:g}")  # fmt: skip


def keys_file_text(tenants: Sequence[Tenant], keys: Mapping[str, str]) -> str:
    return "".join(t.line(keys[t.name]) + "\n" for t in tenants)


def cluster_config(
    cfg: FlowBenchConfig, settings: RunSettings, keys_file: Path, gateways: int
) -> ClusterConfig:
    return ClusterConfig(
        num_prefill=1, num_decode=1, gateway_port=0, http_port=-1, worker_threads=1,
        worker_kv_cache_bytes=cfg.worker_kv_cache_bytes, model=settings.model,
        model_cache_dir=settings.model_cache_dir, placement="redis",
        max_streams=cfg.max_streams, pin_workers=cfg.pin_workers,
        api_keys_file=str(keys_file), gateways=gateways, gateway_args=cfg.gateway_args,
    )  # fmt: skip


class FlowCluster:
    def __init__(
        self,
        cfg: FlowBenchConfig,
        settings: RunSettings,
        tenants: Sequence[Tenant],
        gateways: int = 1,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        self.tenants = tuple(tenants)
        self.gateways = gateways
        # Fresh keys per run: the file lives only as long as the cluster.
        self.keys = {t.name: f"bench-{t.name}-{secrets.token_hex(12)}" for t in tenants}
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.cluster: LocalCluster | None = None

    def __enter__(self) -> FlowCluster:
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-flow-")
        keys_file = Path(self._dir.name) / "api_keys"
        keys_file.write_text(keys_file_text(self.tenants, self.keys))
        keys_file.chmod(0o600)
        cluster_cfg = cluster_config(self.cfg, self.settings, keys_file, self.gateways)
        self.cluster = LocalCluster(cluster_cfg)
        try:
            self.cluster.start()  # stops what it started if it fails
        except BaseException:
            self._dir.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self._dir is not None:
            self._dir.cleanup()

    @property
    def local(self) -> LocalCluster:
        if self.cluster is None:
            raise RuntimeError("the cluster is not started: use `with FlowCluster(...)`")
        return self.cluster

    @property
    def addresses(self) -> list[str]:
        return self.local.gateway_addresses


async def warm_up(fc: FlowCluster, requests: int, max_tokens: int) -> None:
    """`requests` unmeasured requests, one at a time, through every gateway (the first
    tenant's key): the first prefill and decode steps of a process are slow."""
    key = fc.keys[fc.tenants[0].name]
    for address in fc.addresses:
        async with GatewayClient(address, api_key=key) as client:
            for i in range(requests):
                request = build_request(
                    f"Warm up {i}: say something about tides.",
                    RequestOptions(max_tokens=max_tokens, ignore_eos=True),
                )
                async for _ in client.generate(request, timeout=120.0):
                    pass


def probe_targets(cluster: LocalCluster) -> list[ProbeTarget]:
    """The cluster's probe target: its workers, Redis and every gateway's /metrics."""
    return [ProbeTarget.local(cluster)]


@dataclass(frozen=True)
class LeakCheck:
    clean: bool
    by_gateway: list[Leaks] = field(default_factory=list)  # one reading per probe (now one)


async def start_leak_probes(fc: FlowCluster) -> list[LeakProbe]:
    """Baselines now (expiry counters, quota windows), for `check_leaks` later."""
    return [await LeakProbe.start(target) for target in probe_targets(fc.local)]


async def check_leaks(probes: Sequence[LeakProbe], timeout_s: float = 10.0) -> LeakCheck:
    """Wait (at most half the shortest lease TTL) until nothing is held anywhere."""
    readings = await asyncio.gather(*(p.wait_clean(timeout_s) for p in probes))
    return LeakCheck(all(r.clean for r in readings), list(readings))
