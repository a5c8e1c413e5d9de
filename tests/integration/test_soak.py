"""The soak, reduced for `make test`: SOAK_TEST_REQUESTS streams at concurrency 32 with
10% client cancels through a real cluster (1 prefill + 1 decode worker, Redis
placement). It must end with no unexpected error, nothing held anywhere (blocks,
requests, KV leases, load leases), no KV lease left to expire, and under 10% RSS growth
of every process over the second half. `make bench` runs the full 2,000 requests
(`python -m loadtest.reliability.soak`, JSON in bench-results/soak.json).
"""

from __future__ import annotations

import asyncio

import pytest

from loadtest.reliability.soak import SoakConfig, run_soak, soak_cluster_config, summary
from services.cluster.local_cluster import LocalCluster
from tests.conftest import MODEL_CACHE

SOAK_TEST_REQUESTS = 300


@pytest.mark.slow
def test_soak_with_cancels_leaks_nothing_and_memory_stays_flat() -> None:
    cluster = LocalCluster(soak_cluster_config(model_cache_dir=MODEL_CACHE))
    try:
        cluster.start()
        report = asyncio.run(run_soak(cluster, SoakConfig(requests=SOAK_TEST_REQUESTS)))
    finally:
        cluster.stop()
    print(summary(report))
    assert sum(report.outcomes.values()) == SOAK_TEST_REQUESTS
    assert report.outcomes.get("ok", 0) > 0 and report.outcomes.get("cancelled", 0) > 0
    assert not report.unexpected, report.unexpected
    assert report.leaks.clean, (report.leaks, report.router)
    assert report.router["owed_releases"] == 0, report.router
    assert report.expired_kv_leases == 0
    assert set(report.rss_growth) == {"gateway", "prefill-0", "decode-0"}
    assert all(g < report.rss_growth_limit for g in report.rss_growth.values()), report.rss_growth
