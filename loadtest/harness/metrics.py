"""Per-request records and the metrics of one run: latency percentiles, throughput,
goodput and SLO attainment, prefix hits, errors.

Lifecycle: the runner fills one `RequestRecord` per request it sent (times are seconds
from the run's start on a monotonic clock); `summarize(records, slo)` reduces them to a
`RunMetrics` once the run is over. Definitions:

- TTFT: send -> first message carrying a token. ITL: gaps between consecutive messages
  carrying tokens (pooled over requests for the percentiles). TPOT: a request's
  (end - first token) / (output tokens - 1). E2E: send -> end of the stream.
- A request meets the SLO when it ended OK, its TTFT is within
  `ttft_ms + ttft_ms_per_token * prompt_tokens` and the `itl_quantile` quantile of its
  own gaps is within `itl_ms` (0.9: at most 10% of its gaps may be slower; 1.0: none).
- SLO attainment = requests meeting the SLO / requests sent (errors count as misses);
  goodput = requests meeting the SLO per second of the run (first send to last end).
- Prefix-hit ratio = cached prompt tokens / prompt tokens, from the final usage.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

OK = "OK"


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 2000.0
    ttft_ms_per_token: float = 0.0
    itl_ms: float = 200.0
    itl_quantile: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0 or self.ttft_ms_per_token < 0:
            raise ValueError("SLOs must be > 0 (the per-token TTFT allowance >= 0)")
        if not 0.0 < self.itl_quantile <= 1.0:
            raise ValueError(f"itl_quantile must be in (0, 1], got {self.itl_quantile}")

    def ttft_limit_s(self, prompt_tokens: int) -> float:
        return (self.ttft_ms + self.ttft_ms_per_token * prompt_tokens) / 1000.0


@dataclass
class RequestRecord:
    request_id: str
    kind: str
    sent_s: float
    code: str = OK  # gRPC status code name
    first_token_s: float | None = None
    finished_s: float = 0.0
    token_gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ttft_met(rec: RequestRecord, slo: Slo) -> bool:
    ttft = rec.ttft_s
    return rec.ok and ttft is not None and ttft <= slo.ttft_limit_s(rec.prompt_tokens)


def itl_met(rec: RequestRecord, slo: Slo) -> bool:
    if not rec.ok:
        return False
    if not rec.token_gaps_s:
        return True  # one token: no gap to be late
    return percentile(rec.token_gaps_s, 100.0 * slo.itl_quantile) <= slo.itl_ms / 1000.0


def slo_met(rec: RequestRecord, slo: Slo) -> bool:
    return ttft_met(rec, slo) and itl_met(rec, slo)


@dataclass(frozen=True)
class Dist:
    """Percentiles in milliseconds (NaN when there was nothing to measure)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Iterable[float | None]) -> Dist:
        ms = [1000.0 * v for v in values if v is not None]
        mean = sum(ms) / len(ms) if ms else math.nan
        return cls(len(ms), mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass(frozen=True)
class KindMetrics:
    sent: int
    ok: int
    slo_attainment: float
    ttft_ms: Dist
    itl_ms: Dist


@dataclass(frozen=True)
class RunMetrics:
    sent: int
    ok: int
    errors: int
    errors_by_code: dict[str, int]
    duration_s: float
    request_throughput: float  # OK requests / s
    output_token_throughput: float  # generated tokens / s
    total_token_throughput: float  # prompt + generated tokens / s (OK requests)
    goodput: float  # requests meeting the SLO / s
    goodput_token_throughput: float  # output tokens of requests meeting the SLO / s
    slo_attainment: float
    ttft_attainment: float
    itl_attainment: float
    ttft_ms: Dist
    itl_ms: Dist
    tpot_ms: Dist
    e2e_ms: Dist
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    prefix_hit_ratio: float
    by_kind: dict[str, KindMetrics]


def _share(n: int, total: int) -> float:
    return n / total if total else 0.0


def _kind_metrics(records: Sequence[RequestRecord], slo: Slo) -> KindMetrics:
    ok = [r for r in records if r.ok]
    return KindMetrics(
        sent=len(records),
        ok=len(ok),
        slo_attainment=_share(sum(slo_met(r, slo) for r in records), len(records)),
        ttft_ms=Dist.of_seconds(r.ttft_s for r in ok),
        itl_ms=Dist.of_seconds(g for r in ok for g in r.token_gaps_s),
    )


def summarize(records: Sequence[RequestRecord], slo: Slo) -> RunMetrics:
    ok = [r for r in records if r.ok]
    duration = (
        max(r.finished_s for r in records) - min(r.sent_s for r in records) if records else 0.0
    )
    per_s = 1.0 / duration if duration > 0 else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    met = sum(slo_met(r, slo) for r in records)
    kinds = sorted({r.kind for r in records})
    return RunMetrics(
        sent=len(records),
        ok=len(ok),
        errors=len(records) - len(ok),
        errors_by_code=dict(Counter(r.code for r in records if not r.ok)),
        duration_s=duration,
        request_throughput=len(ok) * per_s,
        output_token_throughput=output * per_s,
        total_token_throughput=(prompt + output) * per_s,
        goodput=met * per_s,
        goodput_token_throughput=sum(r.output_tokens for r in ok if slo_met(r, slo)) * per_s,
        slo_attainment=_share(met, len(records)),
        ttft_attainment=_share(sum(ttft_met(r, slo) for r in records), len(records)),
        itl_attainment=_share(sum(itl_met(r, slo) for r in records), len(records)),
        ttft_ms=Dist.of_seconds(r.ttft_s for r in ok),
        itl_ms=Dist.of_seconds(g for r in ok for g in r.token_gaps_s),
        tpot_ms=Dist.of_seconds(r.tpot_s for r in ok),
        e2e_ms=Dist.of_seconds(r.e2e_s for r in ok),
        prompt_tokens=prompt,
        cached_tokens=sum(r.cached_tokens for r in ok),
        output_tokens=output,
        prefix_hit_ratio=_share(sum(r.cached_tokens for r in ok), prompt),
        by_kind={k: _kind_metrics([r for r in records if r.kind == k], slo) for k in kinds},
    )


def max_rate_at(points: Sequence[tuple[float, float]], target: float) -> tuple[float, str]:
    """The highest arrival rate whose attainment stays >= `target`, from (rate, attainment)
    points: walking up from the lowest rate, the crossing is interpolated linearly between
    the last point that holds and the first that does not. The qualifier says how far to
    trust it: `interpolated`, `at_least` (every point held: the sweep stopped too early)
    or `below_sweep` (even the lowest rate missed: 0.0)."""
    ordered = sorted(points)
    if not ordered or ordered[0][1] < target:
        return 0.0, "below_sweep"
    for (r0, a0), (r1, a1) in itertools.pairwise(ordered):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "interpolated"
    return ordered[-1][0], "at_least"
