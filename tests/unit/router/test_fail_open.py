"""Redis dies mid-run and comes back empty: routing never stops, then resyncs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.placement import NoWorkerError, RouteQuery
from services.router.redis_client import connect
from services.router.registry import Registry
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import worker


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as s:
        yield s


def test_redis_stop_fails_open_and_restart_resyncs_from_heartbeats(
    server: EmbeddedRedis,
) -> None:
    workers = [worker(f"p{i}", "prefill") for i in range(2)]
    workers += [worker(f"d{i}", "decode") for i in range(2)]
    worker_side = Registry(connect(server.url), Keyspace("pdserve"), ttl_s=30)
    for w in workers:
        worker_side.register(w)
    cfg = RouterConfig(membership_refresh_s=0, redis_retry_s=0.01, redis_timeout_s=0.2)
    router = Router(connect(server.url, cfg.redis_timeout_s), cfg)

    before = [router.route_detailed(RouteQuery(str(i), [i] * 40, "t")) for i in range(10)]
    assert not any(r.fail_open for r in before) and router.stats.fail_open == 0

    server.stop()
    during = [router.route_detailed(RouteQuery(str(i), [i % 3] * 40, "t")) for i in range(50)]
    assert all(r.fail_open for r in during)
    assert router.stats.fail_open == 100  # two pools per decision
    assert router.stats.redis_errors >= 1
    for routed in during:
        assert all(p.load < p.bound for p in routed.placements)  # bounded on local counts
        router.release(routed.decision.load_lease_ids)
    assert router.local.counts("prefill") == {}
    for routed in before:
        router.release(routed.decision.load_lease_ids)  # Redis is down: kept, not raised
    assert router.stats.release_failures == router.stats.owed_releases == 20

    server.start()  # same socket, no data: the registry is empty until heartbeats
    resync = router.route_detailed(RouteQuery("r", [1] * 40, "t"))
    assert resync.fail_open  # Redis is back but lists no workers yet: last known ones
    router.release(resync.decision.load_lease_ids)
    assert router.stats.owed_releases == 0  # sent (the new Redis no longer had them)
    assert all(worker_side.heartbeat(w) for w in workers)  # each re-creates its registration

    fail_open_so_far = router.stats.fail_open
    after = [router.route_detailed(RouteQuery(str(i), [i] * 40, "t")) for i in range(10)]
    assert not any(r.fail_open for r in after)
    assert router.stats.fail_open == fail_open_so_far
    assert router.ledger.snapshot("decode").total == 10
    for routed in after:
        router.release(routed.decision.load_lease_ids)
    assert router.ledger.snapshot("decode").counts == router.ledger.snapshot("prefill").counts == {}


def test_unreachable_redis_and_no_known_workers_is_a_clear_error(
    server: EmbeddedRedis,
) -> None:
    url = server.url
    server.stop()
    cfg = RouterConfig(redis_url=url, redis_timeout_s=0.2)
    router = Router(connect(url, cfg.redis_timeout_s), cfg)
    assert router.refresh() is False
    with pytest.raises(NoWorkerError, match="cannot reach Redis"):
        router.route(RouteQuery("r", [1, 2, 3], "t"))
