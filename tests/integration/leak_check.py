"""The leak check that every integration test which cancels, kills or injects an error
ends with: `loadtest.reliability.leak_probe` on the test's cluster.

`probe = start_probe(cluster)` first thing in the test (the baseline: expiry counters,
quota windows), `assert_cluster_clean(probe)` last. A test whose fault leaves a lease to
expire by design passes `allow_expired_kv` / `allow_expired_load`; a test that knows the
tokens each tenant used passes `quota_used`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from loadtest.reliability.leak_probe import LeakProbe, Leaks, ProbeTarget
from services.cluster.local_cluster import LocalCluster


def start_probe(target: LocalCluster | ProbeTarget) -> LeakProbe:
    if isinstance(target, LocalCluster):
        target = ProbeTarget.local(target)
    return asyncio.run(LeakProbe.start(target))


def assert_cluster_clean(
    probe: LeakProbe,
    *,
    allow_expired_kv: int = 0,
    allow_expired_load: int = 0,
    quota_used: Mapping[str, int] | None = None,
) -> Leaks:
    """Wait (at most half the shortest lease TTL) until nothing is held; fail with the
    last reading otherwise."""
    leaks = asyncio.run(
        probe.wait_clean(
            allow_expired_kv=allow_expired_kv,
            allow_expired_load=allow_expired_load,
            quota_used=quota_used,
        )
    )
    assert leaks.clean, leaks
    return leaks
