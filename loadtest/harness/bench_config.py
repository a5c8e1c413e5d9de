"""Settings of one `pdserve-bench` run (the workload has its own `TrafficConfig`, the
model the shared `RunSettings`).

Every field is a flag with a `PDSERVE_*` env var (`services/common/config.py`); the
config validates itself at construction and is recorded in the results file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loadtest.harness.cost import NodeCosts
from loadtest.harness.metrics import Slo
from loadtest.harness.runner import ARRIVALS
from loadtest.harness.settings import parse_numbers

_LOOPBACK = ("localhost", "::1")


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in _LOOPBACK


@dataclass(frozen=True)
class BenchConfig:
    gateway: str = field(default="127.0.0.1:8470", metadata={"help": "gateway address"})
    allow_remote: bool = field(
        default=False, metadata={"help": "allow a non-loopback gateway (off: loopback only)"}
    )
    arrival: str = field(default="poisson", metadata={"help": "poisson or closed (loop)"})
    rates: str = field(
        default="1", metadata={"help": "poisson: arrival rates in req/s, comma-separated sweep"}
    )
    concurrency: str = field(
        default="4", metadata={"help": "closed: concurrent users, comma-separated sweep"}
    )
    num_requests: int = field(default=100, metadata={"help": "most requests per point"})
    duration_s: float = field(
        default=120.0, metadata={"help": "stop issuing a point's requests after this"}
    )
    request_timeout_s: float = field(
        default=300.0, metadata={"help": "client deadline of one stream (bounds the drain)"}
    )
    warmup_requests: int = field(
        default=2, metadata={"help": "unmeasured requests sent one by one before the points"}
    )
    ttft_slo_ms: float = field(default=2000.0, metadata={"help": "TTFT SLO, fixed part"})
    ttft_slo_ms_per_token: float = field(
        default=0.0, metadata={"help": "TTFT SLO allowance per prompt token (long prompts)"}
    )
    itl_slo_ms: float = field(default=200.0, metadata={"help": "inter-token latency SLO"})
    itl_slo_quantile: float = field(
        default=0.9, metadata={"help": "quantile of a request's own gaps held to the ITL SLO"}
    )
    ignore_eos: bool = field(
        default=True, metadata={"help": "generate exactly max_tokens (ignore end of sequence)"}
    )
    arrival_seed: int = field(default=0, metadata={"help": "seed of the Poisson gaps"})
    out_dir: Path = field(
        default=Path("bench-results/bench"),
        metadata={"help": "where results.json, summary.md and the PNG plots go"},
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    node_cost_per_hour: str = field(
        default="",
        metadata={
            "help": "a worker node's cost per hour, one number or per role "
            "(prefill=2.5,decode=1.8,mixed=2.0): the report gives cost per million output "
            "tokens at the SLO (workers counted from the gateway's ClusterStatus; empty: none)"
        },
    )

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if not self.allow_remote and not is_loopback(self.gateway):
            raise ValueError(
                f"gateway {self.gateway!r} is not a loopback address; "
                "pass --allow-remote true to load a remote cluster"
            )
        parse_numbers(self.rates, float, "rates")
        parse_numbers(self.concurrency, int, "concurrency")
        if self.num_requests < 1 or self.warmup_requests < 0:
            raise ValueError("num_requests must be >= 1 and warmup_requests >= 0")
        if self.duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("duration_s and request_timeout_s must be > 0")
        _ = self.slo  # builds (and so validates) the SLO
        if self.node_cost_per_hour:
            NodeCosts.parse(self.node_cost_per_hour)

    @property
    def rate_list(self) -> list[float]:
        return parse_numbers(self.rates, float, "rates")

    @property
    def concurrency_list(self) -> list[int]:
        return [int(c) for c in parse_numbers(self.concurrency, int, "concurrency")]

    @property
    def slo(self) -> Slo:
        return Slo(
            self.ttft_slo_ms, self.ttft_slo_ms_per_token, self.itl_slo_ms, self.itl_slo_quantile
        )
