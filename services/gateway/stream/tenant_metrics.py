"""Per-tenant request metrics: outcomes, SLO attainment and tokens, by tenant and class.

Lifecycle: `GatewayMetrics` makes one `TenantMetrics` on the process's registry; each
request's telemetry reports its end here (finished with its SLO verdicts and tokens,
cancelled, failed), and the gateway's admission its refusals.

Why a bounded label: tenants are as many as API keys, and every label value is a series
per metric and class. `TenantLabels` gives its own value to at most `limit` tenants, the
busiest by requests in the last full window (and, until the first window ends, the
first `limit` seen); every other tenant counts as "other" (the anonymous tenant is "-",
and competes for a place like any other). A tenant that drops out of the top has its
series removed (Prometheus then marks them stale) and counts as "other" until it is
back, so no more than `limit` tenants' series, and "other"'s, are exported at once.
The usage ledger (`access.usage_ledger`), not these counters, is what to bill from: it
has every tenant, exactly.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

OTHER = "other"  # the label value of every tenant outside the top
ANONYMOUS = "-"  # the label value of the anonymous tenant "" (no API keys)
WINDOW_S = 300.0  # traffic over this long decides the top tenants
TokenUsage = tuple[int, int, int]  # prompt, cached, completion tokens


class TenantOutcome(enum.Enum):
    """How a tenant's request ended, as `pdserve_tenant_requests` counts it."""

    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"
    REFUSED = "refused"  # at admission: quota, overload, stream cap


class TenantLabels:
    """Which tenants get their own label value (see the module docstring). `take_left()`
    hands over the tenants that lost theirs at the last change of the top, once."""

    def __init__(
        self, limit: int, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._window_end = clock() + window_s
        self._counts: collections.Counter[str] = collections.Counter()
        self._top: set[str] = set()
        self._left: set[str] = set()

    def label(self, tenant: str) -> str:
        """`tenant`'s label value for one request of it (counted towards the next top)."""
        tenant = tenant or ANONYMOUS
        now = self._clock()
        if now >= self._window_end:
            top = {t for t, _ in self._counts.most_common(self.limit)}
            self._left |= self._top - top
            self._top = top
            self._counts.clear()
            self._window_end = now + self.window_s
        self._counts[tenant] += 1
        if tenant not in self._top and len(self._top) < self.limit:
            self._top.add(tenant)  # room left: a quiet deployment labels every tenant
            self._left.discard(tenant)
        return tenant if tenant in self._top else OTHER

    def take_left(self) -> set[str]:
        left, self._left = self._left, set()
        return left


class TenantMetrics:
    """`pdserve_tenant_requests`, `pdserve_tenant_slo_met` and `pdserve_tenant_tokens`.
    Names: docs/observability.md. A tenant that leaves the top has its series removed,
    so at most `limit` tenants' (and "other"'s) series are exported at once."""

    def __init__(
        self, registry: CollectorRegistry, limit: int, labels: TenantLabels | None = None
    ) -> None:
        self.labels = labels or TenantLabels(limit)
        self.requests = Counter(
            "pdserve_tenant_requests",
            "Requests by tenant (the busiest; the rest 'other'), class and outcome "
            "(finished, cancelled, failed, refused)",
            ["tenant", "priority", "outcome"],
            registry=registry,
        )
        self.slo_met = Counter(
            "pdserve_tenant_slo_met",
            "Finished requests that met an SLO (ttft, itl, or both), by tenant and class: "
            'attainment is this over pdserve_tenant_requests{outcome="finished"}',
            ["tenant", "priority", "slo"],
            registry=registry,
        )
        self.tokens = Counter(
            "pdserve_tenant_tokens",
            "Tokens of finished requests by tenant and kind (prompt, cached, completion)",
            ["tenant", "kind"],
            registry=registry,
        )
        self._series: dict[str, list[tuple[Counter, tuple[str, ...]]]] = {}

    def finished(
        self, tenant: str, priority: str, ttft_ok: bool, itl_ok: bool, usage: TokenUsage
    ) -> None:
        label = self._label(tenant)
        self._inc(self.requests, (label, priority, TenantOutcome.FINISHED.value))
        for slo, met in (("ttft", ttft_ok), ("itl", itl_ok), ("both", ttft_ok and itl_ok)):
            if met:
                self._inc(self.slo_met, (label, priority, slo))
        for kind, n in zip(("prompt", "cached", "completion"), usage, strict=True):
            self._inc(self.tokens, (label, kind), n)

    def ended(self, tenant: str, priority: str, outcome: TenantOutcome) -> None:
        """A request that did not finish: cancelled, failed or refused."""
        self._inc(self.requests, (self._label(tenant), priority, outcome.value))

    def _label(self, tenant: str) -> str:
        label = self.labels.label(tenant)
        for gone in self.labels.take_left():
            for counter, values in self._series.pop(gone, []):
                counter.remove(*values)
        return label

    def _inc(self, counter: Counter, values: tuple[str, ...], n: float = 1.0) -> None:
        series = self._series.setdefault(values[0], [])
        if (counter, values) not in series:
            series.append((counter, values))
        counter.labels(*values).inc(n)
