"""Settings of the router benchmark: latency cycles, pool shapes, policies and workload.

Every field is a flag with a `PDSERVE_*` env var (`bench_main`); lists are
comma-separated (`--policies bounded,random`, `--system-tokens 64,256`). The workload's
seed is the run's `--seed` (`RunSettings`); the other workload fields default to
`workloads.prefix.WorkloadConfig`'s. The config validates itself when built and is
recorded in the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loadtest.harness.settings import parse_ints, parse_names
from loadtest.router.latency import LatencyPlan
from loadtest.router.pool import POOL_SHAPES
from loadtest.workloads.prefix import SimConfig, Workload, WorkloadConfig
from services.router.router_config import POLICIES


def _pair(values: tuple[int, int]) -> str:
    return ",".join(str(v) for v in values)


@dataclass(frozen=True)
class RouterBenchConfig:
    decisions: int = field(
        default=5000, metadata={"help": "measured route+release cycles per pool shape"}
    )
    latency_warmup: int = field(default=300, metadata={"help": "unmeasured cycles first"})
    latency_inflight: int = field(
        default=16, metadata={"help": "leases held during the latency cycles"}
    )
    pools: str = field(
        default=",".join(POOL_SHAPES), metadata={"help": "pool shapes: mixed and/or pd"}
    )
    workers: int = field(default=8, metadata={"help": "workers per pool"})
    window: int = field(default=64, metadata={"help": "in-flight requests in the hit-rate replay"})
    warmup_requests: int = field(
        default=2000, metadata={"help": "hit-rate requests before the statistics start"}
    )
    cache_factor: float = field(
        default=1.5, metadata={"help": "all workers' cache blocks / the system prompts' blocks"}
    )
    eps: float = field(default=0.25, metadata={"help": "the router's load bound: 1 + eps"})
    prefix_blocks: int = field(default=4, metadata={"help": "blocks of the routing prefix key"})
    policies: str = field(default=",".join(POLICIES), metadata={"help": "placement policies"})
    tenants: int = field(default=WorkloadConfig.tenants, metadata={"help": "workload: tenants"})
    prompts_per_tenant: int = field(
        default=WorkloadConfig.prompts_per_tenant,
        metadata={"help": "workload: system prompts per tenant"},
    )
    zipf_s: float = field(
        default=WorkloadConfig.zipf_s, metadata={"help": "workload: Zipf exponent of popularity"}
    )
    system_tokens: str = field(
        default=_pair(WorkloadConfig.system_tokens),
        metadata={"help": "workload: system prompt tokens, lo,hi (inclusive)"},
    )
    suffix_tokens: str = field(
        default=_pair(WorkloadConfig.suffix_tokens),
        metadata={"help": "workload: unique user suffix tokens, lo,hi (inclusive)"},
    )
    requests: int = field(
        default=WorkloadConfig.requests, metadata={"help": "workload: requests replayed"}
    )
    restarts: int = field(
        default=3,
        metadata={"help": "workers restarted (emptied) during the residency measurement"},
    )
    report_every: int = field(
        default=8,
        metadata={"help": "placements between the simulated workers' residency reports"},
    )
    replicas: str = field(
        default="1,2,4,8",
        metadata={"help": "router replica counts of the scale measurement (empty: skip it)"},
    )

    def __post_init__(self) -> None:
        if self.decisions < 1 or self.latency_warmup < 0 or self.latency_inflight < 1:
            raise ValueError("need decisions >= 1, latency_warmup >= 0, latency_inflight >= 1")
        _ = self.pool_shapes, self.policy_names, self.replica_counts  # parses (validates) them
        if self.restarts < 0 or self.report_every < 1:
            raise ValueError("need restarts >= 0 and report_every >= 1")
        if self.cache_factor <= 0:
            raise ValueError(f"cache_factor must be > 0, got {self.cache_factor}")
        if self.warmup_requests >= self.requests:
            raise ValueError("warmup_requests must leave some requests to measure")
        self.workload(seed=0)  # validates the workload fields
        SimConfig(self.workers, 1, self.window, self.warmup_requests)  # validates the rest

    @property
    def replica_counts(self) -> tuple[int, ...]:
        if not self.replicas:
            return ()
        counts = parse_ints(self.replicas, "replicas")
        if any(n < 1 for n in counts):
            raise ValueError(f"replicas must be >= 1, got {self.replicas!r}")
        return counts

    @property
    def pool_shapes(self) -> tuple[str, ...]:
        return parse_names(self.pools, "pools", tuple(POOL_SHAPES))

    @property
    def policy_names(self) -> tuple[str, ...]:
        return parse_names(self.policies, "policies", POLICIES)

    def workload(self, seed: int) -> WorkloadConfig:
        lo, hi = parse_ints(self.system_tokens, "system_tokens", count=2)
        suffix_lo, suffix_hi = parse_ints(self.suffix_tokens, "suffix_tokens", count=2)
        return WorkloadConfig(
            tenants=self.tenants, prompts_per_tenant=self.prompts_per_tenant,
            zipf_s=self.zipf_s, system_tokens=(lo, hi), suffix_tokens=(suffix_lo, suffix_hi),
            requests=self.requests, seed=seed,
        )  # fmt: skip

    def latency_plan(self) -> LatencyPlan:
        return LatencyPlan(self.decisions, self.latency_warmup, self.latency_inflight,
                           self.workers, self.eps, self.prefix_blocks)  # fmt: skip

    def sim_config(self, workload: Workload) -> SimConfig:
        capacity = math.ceil(self.cache_factor * workload.hot_blocks / self.workers)
        return SimConfig(self.workers, max(1, capacity), self.window, self.warmup_requests)
