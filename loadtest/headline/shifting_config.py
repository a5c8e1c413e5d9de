"""Settings of the shifting-workload benchmark (`shifting`): elastic roles against the
static 1P+1D split and 2 mixed workers on phases of chat and long prompts, and its SLO.

The defaults are the full run (about 45 minutes on the 2-core host). The phase rates
are set from the issue-41 runs on that host (ITL SLO 3x its unloaded decode step): chat
at 0.5 req/s sits just under elastic's and colocated's chat-only capacity and above the
static split's; 0.15 req/s with half the prompts 1-4k tokens long keeps one prefill core
about 80% busy. Each phase lasts 120 s, four role windows (`--role-window-s`, 30 s), so
the workers' role planner can act within it. On another host, scale the rates with
`--rate-scales` (a short sweep finds each deployment's capacity there).

SLO: TTFT <= 2 s + 12 ms per prompt token, as the headline's; the ITL SLO is derived from
this machine unless given: `--itl-slo-step-factor` (3) times the unloaded decode step,
the median gap between streamed tokens of the warm-up requests (sent one at a time to
every deployment through its gateway), rounded to a whole ms, as the headline's 250 ms
was about 3x a step on the host it was set on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.precision import DType
from loadtest.harness.metrics import RequestRecord, Slo
from loadtest.harness.settings import parse_numbers
from loadtest.headline.config import system_names
from loadtest.headline.phases import Phase, parse_phases


@dataclass(frozen=True)
class ShiftingConfig:
    systems: str = field(
        default="elastic,static,colocated",
        metadata={
            "help": "the deployments (`deployment`), comma-separated; the first is held "
            "against the better of the others"
        },
    )
    phases: str = field(
        default="0:0.5:120,0.5:0.15:120,0:0.5:120",
        metadata={
            "help": "the phases in order, comma-separated LONG_FRACTION:RATE:SECONDS (share "
            "of 1-4k-token prompts, Poisson req/s, length)"
        },
    )
    rate_scales: str = field(
        default="1",
        metadata={
            "help": "multipliers of every phase's rate, comma-separated: one point each; "
            "two or more also give each deployment's capacity (the highest scale "
            "holding the attainment target over the whole schedule)"
        },
    )
    rounds: int = field(
        default=2,
        metadata={"help": "paired rounds per rate scale (the ratios are their medians)"},
    )
    target_ratio: float = field(
        default=1.2, metadata={"help": "first deployment / the better other one, to meet"}
    )
    attainment_target: float = field(
        default=0.9, metadata={"help": "attainment that defines a capacity (a sweep)"}
    )
    request_timeout_s: float = field(
        default=120.0, metadata={"help": "client deadline of one stream (a miss when hit)"}
    )
    warmup_requests: int = field(
        default=4,
        metadata={"help": "unmeasured chat requests, one at a time, per deployment"},
    )
    ttft_slo_ms: float = field(default=2000.0, metadata={"help": "TTFT SLO, fixed part"})
    ttft_slo_ms_per_token: float = field(
        default=12.0, metadata={"help": "TTFT SLO allowance per prompt token"}
    )
    itl_slo_ms: float = field(
        default=0.0,
        metadata={"help": "inter-token latency SLO (0: derived from the unloaded decode step)"},
    )
    itl_slo_step_factor: float = field(
        default=3.0, metadata={"help": "a derived ITL SLO is this many unloaded decode steps"}
    )
    itl_slo_quantile: float = field(
        default=0.9, metadata={"help": "quantile of a request's own gaps held to the ITL SLO"}
    )
    local_prefill_max_tokens: int = field(
        default=512,
        metadata={"help": "1P+1D gateways' conditional disaggregation threshold"},
    )
    pin_workers: bool = field(default=True, metadata={"help": "one CPU core per worker"})
    dtype: DType | None = field(
        default=None,
        metadata={"help": "workers' compute dtype (unset: their default, auto: bf16 where native)"},
    )
    kv_backend: str = field(default="nixl", metadata={"help": "KV transfer backend"})
    worker_kv_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "KV pool per worker (a 4k prompt needs 180 MiB)"}
    )
    out_dir: Path = field(
        default=Path("bench-results/shifting"),
        metadata={"help": "shifting.json and shifting.md go here"},
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self) -> None:
        _ = self.system_list, self.phase_list, self.scale_list  # validates the lists
        if self.rounds < 1 or self.warmup_requests < 0:
            raise ValueError("rounds must be >= 1 and warmup_requests >= 0")
        if self.request_timeout_s <= 0 or self.target_ratio <= 0:
            raise ValueError("request_timeout_s and target_ratio must be > 0")
        if not 0.0 < self.attainment_target <= 1.0:
            raise ValueError("attainment_target must be in (0, 1]")
        if self.itl_slo_ms < 0 or self.itl_slo_step_factor <= 0:
            raise ValueError("itl_slo_ms must be >= 0 and itl_slo_step_factor > 0")
        if self.derives_itl_slo and self.warmup_requests < 1:
            raise ValueError("a derived ITL SLO (itl_slo_ms 0) needs warmup_requests >= 1")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        _ = self.slo(100.0)  # validates the SLO's other settings

    @property
    def system_list(self) -> tuple[str, ...]:
        return system_names(self.systems)

    @property
    def phase_list(self) -> list[Phase]:
        return parse_phases(self.phases)

    @property
    def scale_list(self) -> list[float]:
        return sorted(set(parse_numbers(self.rate_scales, float, "rate_scales")))

    @property
    def derives_itl_slo(self) -> bool:
        return self.itl_slo_ms == 0

    def slo(self, step_ms: float | None) -> Slo:
        """The SLO, its ITL part derived from `step_ms` (the unloaded decode step) unless
        `itl_slo_ms` is given."""
        if self.derives_itl_slo:
            if step_ms is None or not step_ms > 0:
                raise ValueError("a derived ITL SLO needs an unloaded decode step time")
            itl = float(max(1, round(self.itl_slo_step_factor * step_ms)))  # whole ms
        else:
            itl = self.itl_slo_ms
        return Slo(self.ttft_slo_ms, self.ttft_slo_ms_per_token, itl, self.itl_slo_quantile)


def unloaded_step_ms(records: Sequence[RequestRecord]) -> float | None:
    """The median gap between streamed tokens of requests that ran alone (the warm-up's),
    in ms: an unloaded decode step as a client sees it. None if nothing streamed two
    tokens."""
    gaps = [g for r in records if r.ok for g in r.token_gaps_s]
    return 1000.0 * statistics.median(gaps) if gaps else None
