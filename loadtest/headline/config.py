"""Settings of the headline benchmark: disaggregated 1 prefill + 1 decode against 2 mixed
(`--systems` picks the deployments; `deployment` describes each).

The defaults are the full run (about 40 minutes); `make bench` passes a shorter sweep.
SLOs (chosen for SmolLM2-135M in float32 on one CPU core per worker on the 2-core
development host, and kept fixed since: when they were set a prompt's own prefill cost
about 4.5 ms/token at 512 tokens and 10.6 ms/token at 4k, and a decode step at small
batch 60-90 ms; since prefill attention takes torch's fused kernel, 3.2 and 5.2 ms/token):

- TTFT <= 2 s + 12 ms per prompt token: a chat prompt (200-450 tokens) gets 4.4-7.4 s,
  many times its own prefill; a 4k-token prompt gets 51 s, about 2.4x its prefill alone.
- p90 of each request's inter-token gaps <= 250 ms: about 3x an unloaded decode step,
  headroom for a shared machine, and far below one prefill chunk step (1.3-1.8 s at the
  default 256-token budget, 1.7-3.5 s at 512), which is what a colocated decode waits
  through when a long prompt lands on its worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.precision import DType
from loadtest.harness.capacity_search import SearchConfig
from loadtest.harness.metrics import Slo
from loadtest.harness.settings import parse_names, parse_numbers
from loadtest.headline.deployment import SYSTEMS


@dataclass(frozen=True)
class SharedSettings:
    """The settings both headline benchmarks take, declared once: the client's deadline,
    the SLO's TTFT parts and ITL quantile, the attainment target, and how each
    deployment's workers run. `HeadlineConfig` and `shifting_config.ShiftingConfig`
    declare these fields again, flat, with `shared_field` (default and help from here),
    and check them through `SharedSettings.of(self)` in their `__post_init__`.

    Flat fields rather than an embedded `SharedSettings`: `services.common.config` makes
    one flag and `PDSERVE_*` env var per top-level field, and a result file's `config`
    object is the config's `dataclasses.asdict`, so flat fields keep both benchmarks'
    flags and JSON exactly as they were. A field whose default differs between the two
    (the deployments, the warm-up, the ITL SLO, the target ratio, the output directory)
    is each one's own.
    """

    request_timeout_s: float = field(
        default=120.0, metadata={"help": "client deadline of one stream (a miss when hit)"}
    )
    ttft_slo_ms: float = field(default=2000.0, metadata={"help": "TTFT SLO, fixed part"})
    ttft_slo_ms_per_token: float = field(
        default=12.0, metadata={"help": "TTFT SLO allowance per prompt token"}
    )
    itl_slo_quantile: float = field(
        default=0.9, metadata={"help": "quantile of a request's own gaps held to the ITL SLO"}
    )
    attainment_target: float = field(
        default=0.9, metadata={"help": "attainment that defines a deployment's capacity"}
    )
    local_prefill_max_tokens: int = field(
        default=512,
        metadata={
            "help": "the disaggregated gateway's conditional disaggregation threshold "
            "(0 = every request takes the prefill hop)"
        },
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
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if not 0.0 < self.attainment_target <= 1.0:
            raise ValueError("attainment_target must be in (0, 1]")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        _ = self.slo(1.0)  # validates the SLO's shared parts

    @classmethod
    def of(cls, cfg: object) -> SharedSettings:
        """The shared settings of a config that declares every one of them."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def slo(self, itl_ms: float) -> Slo:
        """The SLO with these TTFT parts and quantile, and `itl_ms` as its ITL bound."""
        return Slo(self.ttft_slo_ms, self.ttft_slo_ms_per_token, itl_ms, self.itl_slo_quantile)


def shared_field(name: str, help_text: str = "") -> Any:
    """A config's field declared as `SharedSettings` declares `name`: its default, and its
    help unless `help_text` words it for one benchmark."""
    declared = {f.name: f for f in fields(SharedSettings)}
    if name not in declared:
        raise ValueError(f"{name!r} is not a SharedSettings field")
    shared = declared[name]
    return field(default=shared.default, metadata={"help": help_text or shared.metadata["help"]})


@dataclass(frozen=True)
class HeadlineConfig:
    systems: str = field(
        default="disaggregated,colocated",
        metadata={
            "help": f"the deployments, comma-separated, among {', '.join(SYSTEMS)}: the "
            "first is the one the ratios are of (elastic,static,colocated: elastic roles "
            "against the static split and 2 mixed workers in one run)"
        },
    )
    rates: str = field(
        default="",
        metadata={
            "help": "fixed arrival rates of the long-prompt mix (req/s), comma-separated; "
            "empty: each deployment's capacity is searched for (the search flags below)"
        },
    )
    start_rate: float = field(default=0.3, metadata={"help": "search: the first probe's rate"})
    max_probes: int = field(default=7, metadata={"help": "search: most probes per deployment"})
    bisect_steps: int = field(
        default=2, metadata={"help": "search: probes narrowing the bracket once one is found"}
    )
    min_rate: float = field(default=0.02, metadata={"help": "search: lowest rate it probes"})
    max_rate: float = field(default=16.0, metadata={"help": "search: highest rate it probes"})
    local_prefill_max_tokens: int = shared_field("local_prefill_max_tokens")
    elastic_roles: bool = field(
        default=True,
        metadata={
            "help": "the disaggregated gateway's elastic roles (its prefill worker also "
            "serves short requests whole when it has room); false: the static 1P+1D split"
        },
    )
    num_requests: int = field(default=40, metadata={"help": "most requests per rate"})
    duration_s: float = field(default=150.0, metadata={"help": "stop issuing a rate after"})
    request_timeout_s: float = shared_field("request_timeout_s")
    warmup_requests: int = field(
        default=3, metadata={"help": "unmeasured requests before each deployment's sweep"}
    )
    stop_below_attainment: float = field(
        default=0.5, metadata={"help": "skip a deployment's higher rates once below this"}
    )
    short_rate: float = field(
        default=0.5,
        metadata={
            "help": "arrival rate of the short-prompt-only (chat) point; with chat_search, "
            "where that search starts"
        },
    )
    chat_search: bool = field(
        default=True,
        metadata={
            "help": "search each deployment's capacity on short prompts only too (else one "
            "chat point at short_rate)"
        },
    )
    short_num_requests: int = field(default=40, metadata={"help": "requests of that point"})
    short_duration_s: float = field(default=120.0, metadata={"help": "its time bound"})
    ttft_slo_ms: float = shared_field("ttft_slo_ms")
    ttft_slo_ms_per_token: float = shared_field("ttft_slo_ms_per_token")
    itl_slo_ms: float = field(default=250.0, metadata={"help": "inter-token latency SLO"})
    itl_slo_quantile: float = shared_field("itl_slo_quantile")
    attainment_target: float = shared_field("attainment_target")
    target_ratio: float = field(
        default=1.5,
        metadata={
            "help": "capacity ratio to meet: the first deployment over the reference "
            "(colocated when it runs and is not the first, else the second)"
        },
    )
    pin_workers: bool = shared_field("pin_workers")
    dtype: DType | None = shared_field("dtype")  # noqa: RUF009 -- a Field; its default is None
    kv_backend: str = shared_field("kv_backend")
    worker_kv_cache_bytes: int = shared_field("worker_kv_cache_bytes")
    out_dir: Path = field(
        default=Path("bench-results"),
        metadata={"help": "headline.json, headline.md and headline_*.png go here"},
    )
    progress: bool = shared_field("progress")

    def __post_init__(self) -> None:
        _ = self.rate_list  # validates a fixed sweep's rates
        if min(self.num_requests, self.short_num_requests) < 1 or self.warmup_requests < 0:
            raise ValueError("request counts must be >= 1 (warmup_requests >= 0)")
        if min(self.duration_s, self.short_duration_s) <= 0:
            raise ValueError("duration_s and short_duration_s must be > 0")
        if self.short_rate <= 0 or self.target_ratio <= 0:
            raise ValueError("short_rate and target_ratio must be > 0")
        if not 0.0 <= self.stop_below_attainment <= 1.0:
            raise ValueError("stop_below_attainment must be in [0, 1]")
        _ = SharedSettings.of(self)  # validates the settings the shifting workload shares
        _ = self.slo  # builds (and so validates) the SLO
        _ = self.search  # validates the search's settings
        _ = self.system_list  # validates the deployments

    @property
    def system_list(self) -> tuple[str, ...]:
        """The deployments, the subject of the ratios first; at least two, no repeats."""
        return system_names(self.systems)

    @property
    def rate_list(self) -> list[float]:
        """The fixed sweep's rates; empty when the capacity is searched for."""
        return sorted(parse_numbers(self.rates, float, "rates")) if self.rates.strip() else []

    @property
    def search(self) -> SearchConfig:
        """The capacity search of each deployment (`capacity_search`): a probe is one
        point of up to `num_requests` requests within `duration_s`."""
        return SearchConfig(
            start_rate=self.start_rate, bisect_steps=self.bisect_steps,
            max_probes=self.max_probes, min_rate=self.min_rate, max_rate=self.max_rate,
            target=self.attainment_target,
        )  # fmt: skip

    @property
    def slo(self) -> Slo:
        return SharedSettings.of(self).slo(self.itl_slo_ms)


def system_names(text: str) -> tuple[str, ...]:
    """'elastic,static' -> ('elastic', 'static'): two or more known deployments, once each."""
    names = parse_names(text, "systems", SYSTEMS)
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"systems must name two or more distinct deployments, got {text!r}")
    return names
