"""Per-tenant request metrics: outcomes, SLO attainment and tokens, by tenant and class.

Lifecycle: `GatewayMetrics` makes one `TenantMetrics` on the process's registry; each
request's telemetry reports its end here (finished with its SLO verdicts and tokens,
cancelled, failed), and the gateway's admission its refusals.

Why a bounded label: tenants are as many as API keys, and every label value is a series
per metric and class. `TenantLabels` gives its own value to at most `limit` tenants, the
busiest by requests in the last full window (and, until the first window ends, the
first `limit` seen); every other tenant counts as "other". A tenant that drops out of
the top keeps its old series (Prometheus marks them stale) and counts as "other" until
it is back. The usage ledger (`access.usage_ledger`), not these counters, is what to
bill from: it has every tenant, exactly.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

OTHER = "other"  # the label value of every tenant outside the top
ANONYMOUS = "-"  # the label value of the anonymous tenant "" (no API keys)
WINDOW_S = 300.0  # traffic over this long decides the top tenants
TokenUsage = tuple[int, int, int]  # prompt, cached, completion tokens


class TenantLabels:
    """Which tenants get their own label value (see the module docstring)."""

    def __init__(
        self, limit: int, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._window_end = clock() + window_s
        self._counts: collections.Counter[str] = collections.Counter()
        self._top: set[str] = set()

    def label(self, tenant: str) -> str:
        """`tenant`'s label value for one request of it (counted towards the next top)."""
        tenant = tenant or ANONYMOUS
        now = self._clock()
        if now >= self._window_end:
            self._top = {t for t, _ in self._counts.most_common(self.limit)}
            self._counts.clear()
            self._window_end = now + self.window_s
        self._counts[tenant] += 1
        if tenant not in self._top and len(self._top) < self.limit:
            self._top.add(tenant)  # room left: a quiet deployment labels every tenant
        return tenant if tenant in self._top else OTHER


class TenantMetrics:
    """`pdserve_tenant_requests`, `pdserve_tenant_slo_met` and `pdserve_tenant_tokens`.
    Names: docs/observability.md."""

    def __init__(self, registry: CollectorRegistry, limit: int) -> None:
        self.labels = TenantLabels(limit)
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

    def finished(
        self, tenant: str, priority: str, ttft_ok: bool, itl_ok: bool, usage: TokenUsage
    ) -> None:
        label = self.labels.label(tenant)
        self.requests.labels(label, priority, "finished").inc()
        for slo, met in (("ttft", ttft_ok), ("itl", itl_ok), ("both", ttft_ok and itl_ok)):
            if met:
                self.slo_met.labels(label, priority, slo).inc()
        for kind, n in zip(("prompt", "cached", "completion"), usage, strict=True):
            self.tokens.labels(label, kind).inc(n)

    def ended(self, tenant: str, priority: str, outcome: str) -> None:
        """A request that did not finish: cancelled, failed or refused."""
        self.requests.labels(self.labels.label(tenant), priority, outcome).inc()
