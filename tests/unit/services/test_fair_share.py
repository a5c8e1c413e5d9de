"""The fair-share ledger against real Redis: charges decay, backlog marks expire, two
gateway replicas see one ledger, over-share and Jain's index, fail-open."""

from __future__ import annotations

import time

import pytest
import redis

from engine.priority import Priority
from services.gateway.flow.fair_share import FairShare, FairView, TenantService
from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_client import connect

STD, CRIT = Priority.STANDARD, Priority.CRITICAL


def test_charges_accumulate_and_decay(client: redis.Redis, namespace: str) -> None:
    fair = FairShare(client, namespace, half_life_s=0.5)
    fair.sync({STD: {"a": 100.0}}, {})
    view = fair.sync({STD: {"a": 100.0, "b": 50.0}}, {})
    a, b = view.classes[STD]["a"], view.classes[STD]["b"]
    assert 190 < a.attained <= 200 and 45 < b.attained <= 50
    assert not a.backlogged and view.classes[CRIT] == {}
    time.sleep(0.5)
    later = fair.sync({}, {}).classes[STD]["a"].attained
    assert later == pytest.approx(a.attained / 2, rel=0.15)  # one half-life


def test_two_replicas_share_one_ledger(client: redis.Redis, namespace: str) -> None:
    g1, g2 = FairShare(client, namespace), FairShare(client, namespace)
    g1.sync({STD: {"a": 30.0}}, {STD: ["a"]})
    view = g2.sync({STD: {"a": 30.0, "b": 10.0}}, {STD: ["b"]})
    assert view.classes[STD]["a"].attained == pytest.approx(60.0, rel=0.01)
    assert view.classes[STD]["a"].backlogged and view.classes[STD]["b"].backlogged
    # a has had six times b's service while both wait: a is held, b is not.
    assert view.over_share(STD, "a") and not view.over_share(STD, "b")


def test_backlog_marks_expire(client: redis.Redis, namespace: str) -> None:
    fair = FairShare(client, namespace, backlog_ttl_s=0.2)
    fair.sync({STD: {"a": 5.0}}, {STD: ["a", "b"]})
    time.sleep(0.3)
    view = fair.sync({}, {})
    assert not view.classes[STD]["a"].backlogged and "b" not in view.classes[STD]


def test_over_share_needs_another_backlogged_tenant() -> None:
    alone = FairView({STD: {"a": TenantService(100.0, True), "b": TenantService(0.0, False)}})
    assert not alone.over_share(STD, "a")  # nobody else waits: take what is free
    close = FairView({STD: {"a": TenantService(10.4, True), "b": TenantService(10.0, True)}})
    assert not close.over_share(STD, "a")  # within the slack
    far = FairView({STD: {"a": TenantService(12.0, True), "b": TenantService(10.0, True)}})
    assert far.over_share(STD, "a") and not far.over_share(STD, "unknown")


def test_fairness_index() -> None:
    equal = FairView({STD: {t: TenantService(5.0, True) for t in "abc"}})
    assert equal.fairness_index(STD) == pytest.approx(1.0)
    one = FairView({STD: {"a": TenantService(9.0, True), "b": TenantService(0.0, True)}})
    assert one.fairness_index(STD) == pytest.approx(0.5)
    assert FairView().fairness_index(STD) == 1.0


def test_fails_open_without_redis() -> None:
    server = EmbeddedRedis().start()
    fair = FairShare(connect(server.url, timeout_s=0.5), "gone")
    server.close()
    assert fair.sync({STD: {"a": 1.0}}, {STD: ["a"]}) == FairView()
