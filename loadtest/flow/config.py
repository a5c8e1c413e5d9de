"""The knobs the flow-control benchmarks share: the requests, the cluster, the capacity
search, the SLO tolerances and the gateway's admission flags.

Lifecycle: `OverloadBenchConfig` and `FairnessBenchConfig` extend `FlowBenchConfig`
with their own fields; `bench_main` turns every field into a flag (and a `PDSERVE_*`
env var) and builds the config once per run. The benchmark then reads the composed
pieces through the properties: `shape` (the requests), `search` (the capacity search),
`slo(...)` (budgets and tolerances) and `gateway_args` (the admission flags handed to
every gateway of the cluster).

The admission flags default to None, which passes nothing, so each gateway keeps its own
default (and a gateway that does not know a flag yet is never given it). The budgets the
SLO judges by are the same: the run's value if set, else the gateway's default.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from engine.priority import Priority
from loadtest.flow.slo import FlowSlo
from loadtest.flow.traffic import RequestShape
from loadtest.harness.capacity_search import SearchConfig

#: Gateway flags set only when the run sets them: config field -> flag.
ADMISSION_FLAGS = (
    "ttft_budget_critical_s", "ttft_budget_standard_s", "ttft_budget_sheddable_s",
    "waiting_room_size", "admission_control", "itl_budget_s",
)  # fmt: skip


@dataclass(frozen=True)
class FlowBenchConfig:
    prompt_tokens: int = field(default=200, metadata={"help": "prompt tokens per request"})
    output_tokens: int = field(default=32, metadata={"help": "output tokens per request"})
    request_timeout_s: float = field(
        default=60.0, metadata={"help": "client deadline of one stream"}
    )
    warmup_requests: int = field(
        default=4, metadata={"help": "unmeasured requests per gateway before anything"}
    )
    max_streams: int = field(default=64, metadata={"help": "gateway: concurrent stream cap"})
    worker_kv_cache_bytes: int = field(
        default=256 << 20, metadata={"help": "KV pool bytes per worker"}
    )
    pin_workers: bool = field(default=False, metadata={"help": "pin each worker to a core"})
    # -- the capacity search
    capacity_rate: float | None = field(
        default=None,
        metadata={"help": "skip the search: this rate (req/s) is the capacity, one probe"},
    )
    search_start_rate: float = field(
        default=1.0, metadata={"help": "capacity search: first probe's rate (req/s)"}
    )
    search_probe_s: float = field(
        default=20.0, metadata={"help": "capacity search: seconds of traffic per probe"}
    )
    search_min_requests: int = field(
        default=20,
        metadata={
            "help": "capacity search: a low-rate probe sends for longer, "
            "to expect at least this many requests"
        },
    )
    search_bisect_steps: int = field(
        default=2, metadata={"help": "capacity search: probes narrowing the bracket"}
    )
    search_max_probes: int = field(
        default=7, metadata={"help": "capacity search: most probes in all"}
    )
    search_min_rate: float = field(default=0.05, metadata={"help": "capacity search: floor"})
    search_max_rate: float = field(default=64.0, metadata={"help": "capacity search: ceiling"})
    attainment_target: float = field(
        default=0.9, metadata={"help": "attainment a rate must hold to be within capacity"}
    )
    # -- the SLO's tolerances
    immediate_refusal_ms: float = field(
        default=50.0, metadata={"help": "a refusal within this of the send is immediate"}
    )
    budget_tolerance: float = field(
        default=0.1, metadata={"help": "relative tolerance around a class's TTFT budget"}
    )
    refusal_slack_ms: float = field(
        default=200.0, metadata={"help": "extra time a refusal at the budget may take"}
    )
    itl_slo_ms: float | None = field(
        default=None,
        metadata={
            "help": "a served request also meets the SLO only if the p90 of its own token "
            "gaps is within this (default: not judged, TTFT alone)"
        },
    )
    # -- the gateway's admission flags (None: not passed, the gateway's default)
    ttft_budget_critical_s: float | None = field(
        default=None, metadata={"help": "gateway: critical TTFT budget (default: gateway's, 10)"}
    )
    ttft_budget_standard_s: float | None = field(
        default=None, metadata={"help": "gateway: standard TTFT budget (default: gateway's, 5)"}
    )
    ttft_budget_sheddable_s: float | None = field(
        default=None, metadata={"help": "gateway: sheddable TTFT budget (default: gateway's, 2)"}
    )
    waiting_room_size: int | None = field(
        default=None, metadata={"help": "gateway: waiting room places (default: gateway's)"}
    )
    admission_control: bool | None = field(
        default=None, metadata={"help": "gateway: admission control on/off (default: gateway's)"}
    )
    itl_budget_s: float | None = field(
        default=None,
        metadata={"help": "gateway: ITL budget of decode-side admission (default: gateway's, off)"},
    )

    def __post_init__(self) -> None:
        RequestShape(self.prompt_tokens, self.output_tokens)
        _ = self.search  # validates the search's fields
        if self.capacity_rate is not None and self.capacity_rate <= 0:
            raise ValueError(f"capacity_rate must be > 0, got {self.capacity_rate}")
        if min(self.request_timeout_s, self.max_streams, self.worker_kv_cache_bytes) <= 0:
            raise ValueError("request_timeout_s, max_streams, worker_kv_cache_bytes must be > 0")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        self.slo()  # validates the tolerances and budgets
        if self.waiting_room_size is not None and self.waiting_room_size < 0:
            raise ValueError(f"waiting_room_size must be >= 0, got {self.waiting_room_size}")

    @property
    def shape(self) -> RequestShape:
        return RequestShape(self.prompt_tokens, self.output_tokens)

    @property
    def search(self) -> SearchConfig:
        return SearchConfig(
            start_rate=self.search_start_rate, probe_s=self.search_probe_s,
            min_requests=self.search_min_requests,
            bisect_steps=self.search_bisect_steps, max_probes=self.search_max_probes,
            min_rate=self.search_min_rate, max_rate=self.search_max_rate,
            target=self.attainment_target,
        )  # fmt: skip

    def slo(self) -> FlowSlo:
        overrides = {
            Priority.CRITICAL: self.ttft_budget_critical_s,
            Priority.STANDARD: self.ttft_budget_standard_s,
            Priority.SHEDDABLE: self.ttft_budget_sheddable_s,
        }
        itl_s = None if self.itl_slo_ms is None else self.itl_slo_ms / 1000
        return FlowSlo.of(
            overrides, self.immediate_refusal_ms / 1000, self.budget_tolerance,
            self.refusal_slack_ms / 1000, itl_s,
        )  # fmt: skip

    @property
    def gateway_args(self) -> str:
        """The admission flags the run sets, shell-quoted for `ClusterConfig`."""
        args: list[str] = []
        for name in ADMISSION_FLAGS:
            value = getattr(self, name)
            if value is not None:
                text = str(value).lower() if isinstance(value, bool) else str(value)
                args += ["--" + name.replace("_", "-"), text]
        return shlex.join(args)
