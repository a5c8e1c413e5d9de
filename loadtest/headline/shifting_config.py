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
from loadtest.headline.config import SharedSettings, shared_field, system_names
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
    attainment_target: float = shared_field(
        "attainment_target", "attainment that defines a capacity (a sweep)"
    )
    request_timeout_s: float = shared_field("request_timeout_s")
    warmup_requests: int = field(
        default=4,
        metadata={"help": "unmeasured chat requests, one at a time, per deployment"},
    )
    ttft_slo_ms: float = shared_field("ttft_slo_ms")
    ttft_slo_ms_per_token: float = shared_field("ttft_slo_ms_per_token")
    itl_slo_ms: float = field(
        default=0.0,
        metadata={"help": "inter-token latency SLO (0: derived from the unloaded decode step)"},
    )
    itl_slo_step_factor: float = field(
        default=3.0, metadata={"help": "a derived ITL SLO is this many unloaded decode steps"}
    )
    itl_slo_quantile: float = shared_field("itl_slo_quantile")
    local_prefill_max_tokens: int = shared_field(
        "local_prefill_max_tokens", "1P+1D gateways' conditional disaggregation threshold"
    )
    pin_workers: bool = shared_field("pin_workers")
    dtype: DType | None = shared_field("dtype")  # noqa: RUF009 -- a Field; its default is None
    kv_backend: str = shared_field("kv_backend")
    worker_kv_cache_bytes: int = shared_field("worker_kv_cache_bytes")
    out_dir: Path = field(
        default=Path("bench-results/shifting"),
        metadata={"help": "shifting.json and shifting.md go here"},
    )
    progress: bool = shared_field("progress")

    def __post_init__(self) -> None:
        _ = self.system_list, self.phase_list, self.scale_list  # validates the lists
        if self.rounds < 1 or self.warmup_requests < 0:
            raise ValueError("rounds must be >= 1 and warmup_requests >= 0")
        if self.target_ratio <= 0:
            raise ValueError("target_ratio must be > 0")
        _ = SharedSettings.of(self)  # validates the settings the headline shares
        if self.itl_slo_ms < 0 or self.itl_slo_step_factor <= 0:
            raise ValueError("itl_slo_ms must be >= 0 and itl_slo_step_factor > 0")
        if self.derives_itl_slo and self.warmup_requests < 1:
            raise ValueError("a derived ITL SLO (itl_slo_ms 0) needs warmup_requests >= 1")
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
        return SharedSettings.of(self).slo(itl)


def unloaded_step_ms(records: Sequence[RequestRecord]) -> float | None:
    """The median gap between streamed tokens of requests that ran alone (the warm-up's),
    in ms: an unloaded decode step as a client sees it. None if nothing streamed two
    tokens."""
    gaps = [g for r in records if r.ok for g in r.token_gaps_s]
    return 1000.0 * statistics.median(gaps) if gaps else None
