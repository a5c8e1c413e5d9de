"""The deployments the headline benchmarks compare, and one running deployment's seat in
a run.

Lifecycle: a benchmark names its deployments (`SYSTEMS`: `disaggregated`, `elastic`,
`static`, `colocated`), builds each one's `ClusterConfig` with `cluster_config` (one
CPU core and one torch thread per worker, router placement on embedded Redis, the same
model), starts them as `LocalCluster`s, and wraps each address in a `Deployment`, whose
`measure` runs one point and adds its wall time to the deployment's account. `turns`
orders the deployments for the i-th point of a run: reversed every other point, so a
drift in the shared host's speed falls on all of them alike.

The four layouts on two cores:

- `disaggregated`: 1 prefill + 1 decode worker, elastic roles as the headline's
  `--elastic-roles` says (the headline's long-standing name for its subject);
- `elastic`: 1 prefill + 1 decode worker, every elastic default on (the gateway's
  elastic roles, the workers' run-time role planner);
- `static`: 1 prefill + 1 decode worker, fixed roles: the gateway's `--elastic-roles
  false` and the workers' `--role-window-s 0` (no role planner), the issue-41 reference;
- `colocated`: 2 mixed workers (chunked prefill beside decode on each).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from engine.precision import DType
from loadtest.harness.bench import now_iso
from loadtest.harness.bench_report import PointResult
from loadtest.harness.metrics import RequestRecord, Slo, summarize
from loadtest.harness.request_spec import BenchRequest
from loadtest.harness.runner import Pace, run_point
from loadtest.harness.settings import RunSettings
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster

SYSTEMS = ("disaggregated", "elastic", "static", "colocated")
#: Gateway and worker flags of the static split: no elastic roles, no role planner.
STATIC_GATEWAY_ARGS = "--elastic-roles false"
STATIC_WORKER_ARGS = "--role-window-s 0"


@dataclass(frozen=True)
class Layout:
    """What a deployment is made of."""

    prefill: int  # prefill workers (0: mixed workers only)
    workers: int  # decode workers, or mixed ones when prefill is 0
    elastic: bool  # gateway elastic roles and the workers' role planner
    description: str  # for the report's title


def layout(name: str, elastic_roles: bool = True) -> Layout:
    """The layout of the deployment `name`; `elastic_roles` decides `disaggregated`'s."""
    if name == "colocated":
        return Layout(0, 2, True, "2 mixed")
    if name == "disaggregated":
        return Layout(1, 1, elastic_roles, "1 prefill + 1 decode")
    if name == "elastic":
        return Layout(1, 1, True, "1P+1D, elastic roles")
    if name == "static":
        return Layout(1, 1, False, "1P+1D, fixed roles")
    raise ValueError(f"unknown deployment {name!r}: one of {', '.join(SYSTEMS)}")


class ClusterKnobs(Protocol):
    """What `cluster_config` reads from a benchmark's config (the headline's and the
    shifting workload's both have it)."""

    @property
    def pin_workers(self) -> bool: ...

    @property
    def dtype(self) -> DType | None: ...

    @property
    def kv_backend(self) -> str: ...

    @property
    def worker_kv_cache_bytes(self) -> int: ...

    @property
    def local_prefill_max_tokens(self) -> int: ...


def cluster_config(
    name: str, knobs: ClusterKnobs, model: RunSettings, elastic_roles: bool = True
) -> ClusterConfig:
    """The cluster of deployment `name`; a disaggregated one gets the conditional
    disaggregation threshold (`local_prefill_max_tokens`, a flag: it also overrides a
    PDSERVE_LOCAL_PREFILL_MAX_TOKENS in the env)."""
    shape = layout(name, elastic_roles)
    fixed = shape.prefill > 0 and not shape.elastic
    return ClusterConfig(
        num_prefill=shape.prefill,
        num_decode=shape.workers,
        gateway_port=0,
        worker_threads=1,
        worker_kv_cache_bytes=knobs.worker_kv_cache_bytes,
        kv_backend=knobs.kv_backend,
        model=model.model,
        model_cache_dir=model.model_cache_dir,
        placement="redis",
        max_streams=1024,
        pin_workers=knobs.pin_workers,
        dtype=knobs.dtype,
        local_prefill_max_tokens=knobs.local_prefill_max_tokens if shape.prefill else None,
        gateway_args=STATIC_GATEWAY_ARGS if fixed else "",
        worker_args=STATIC_WORKER_ARGS if fixed else "",
    )


class Account(Protocol):
    """What a deployment's results keep for it: its name and its measured time."""

    name: str
    wall_s: float


A = TypeVar("A", bound=Account)
T = TypeVar("T")


class Deployment(Generic[A]):
    """One running cluster, its results so far, and the time its points took."""

    def __init__(self, result: A, address: str) -> None:
        self.result = result
        self.address = address
        self.stopped = False  # attainment fell under stop_below_attainment

    async def run(self, requests: Sequence[BenchRequest], pace: Pace) -> list[RequestRecord]:
        """Send the requests at the pace; the records, their time on the account."""
        t0 = time.perf_counter()
        try:
            return await run_point(self.address, requests, pace)
        finally:
            self.result.wall_s += time.perf_counter() - t0

    async def measure(
        self, label: str, requests: Sequence[BenchRequest], pace: Pace, slo: Slo
    ) -> PointResult:
        """One point: the requests at the pace, summarized against the SLO."""
        started = now_iso()
        records = await self.run(requests, pace)
        metrics = summarize(records, slo)
        return PointResult(label, "poisson", pace.rate, None, started, metrics, records)


def turns(deployments: list[T], i: int) -> list[T]:
    """Who runs the i-th point first alternates, so a drift in the shared host's speed
    (it moves by tens of percent within an hour) falls on every deployment alike."""
    return deployments if i % 2 == 0 else deployments[::-1]


@contextmanager
def clusters_up(configs: Sequence[tuple[str, ClusterConfig]], tag: str) -> Iterator[list[str]]:
    """Start each (name, config) cluster in order and yield their gateway addresses; all
    stop on the way out, however it is left. An idle cluster only polls (its workers
    wait on an event), so it costs the measured one next to nothing."""
    clusters = [LocalCluster(config) for _, config in configs]
    try:
        addresses = []
        for (name, _), cluster in zip(configs, clusters, strict=True):
            addresses.append(cluster.start())
            print(f"{tag}: {name} cluster up at {addresses[-1]}", file=sys.stderr)
        yield addresses
    finally:
        for cluster in clusters:
            cluster.stop()
