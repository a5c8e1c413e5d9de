"""The router's Prometheus counters, read from `Router.stats` at scrape time.

Registered by whichever process hosts a router (the gateway, or the standalone router
service) on its telemetry registry; nothing is kept here between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.router import RouterStats


class RouterCollector(Collector):
    """The router's own counters (kept by `Router`) exposed at scrape time."""

    def __init__(self, stats: Callable[[], RouterStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        for name, value, text in (
            ("decisions", s.decisions, "Successful placements"),
            ("overflow", s.overflow, "Placements that skipped the key's first worker (load bound)"),
            ("fail_open", s.fail_open, "Pool placements made locally because Redis was down"),
            ("redis_errors", s.redis_errors, "Redis calls that failed"),
            ("release_failures", s.release_failures, "Lease releases Redis did not get at once"),
            ("marked_down", s.marked_down, "Workers marked down after a call to them failed"),
            ("failovers", s.failovers, "New Redis primaries this router saw"),
            (
                "reconciled_leases",
                s.reconciled_leases,
                "Inherited load leases trimmed to the workers' own counts after a failover",
            ),
            (
                "prefix_run_blocks",
                s.prefix_runs,
                "Leading prompt blocks the picked workers held (reported or modelled)",
            ),
            (
                "prefix_best_run_blocks",
                s.prefix_best_runs,
                "Leading prompt blocks the best candidate held, load bound aside",
            ),
        ):
            yield CounterMetricFamily(f"pdserve_router_{name}", text, value=value)
        yield GaugeMetricFamily(
            "pdserve_router_owed_releases",
            "Lease releases kept to send again once Redis answers",
            value=s.owed_releases,
        )
