"""Tokens-per-minute quotas against real Redis: charge, refuse with a hint, refund,
windows shared by replicas, and fail-open when Redis is gone."""

from __future__ import annotations

import uuid

import pytest
import redis

from services.gateway.access.quota import QuotaExceeded, TokenQuota
from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_client import connect


def test_charge_refuse_and_refund(client: redis.Redis) -> None:
    quota = TokenQuota(client, f"q-{uuid.uuid4().hex[:8]}")
    grant = quota.admit("acme", 100, prompt_tokens=30, max_tokens=50)
    assert grant.charged == 80 and int(client.get(grant.window_key) or 0) == 80
    # Below the limit, a request is admitted even if it crosses it...
    second = quota.admit("acme", 100, prompt_tokens=30, max_tokens=50)
    assert int(client.get(second.window_key) or 0) == 160
    # ...and then the window is spent: refused with the time left as the hint.
    with pytest.raises(QuotaExceeded, match="tokens_per_minute") as err:
        quota.admit("acme", 100, prompt_tokens=1, max_tokens=1)
    assert 0 < err.value.retry_after_s <= 60
    # Refunds bring the window to the tokens actually used and reopen it.
    quota.settle(grant, completion_tokens=10)
    quota.settle(second, completion_tokens=0)
    assert int(client.get(grant.window_key) or 0) == 40 + 30
    assert quota.admit("acme", 100, prompt_tokens=1, max_tokens=1).charged == 2
    assert 0 < client.pttl(grant.window_key) <= 120_000


def test_tenants_and_replicas(client: redis.Redis) -> None:
    ns = f"q-{uuid.uuid4().hex[:8]}"
    a, b = TokenQuota(client, ns), TokenQuota(client, ns)  # two gateway replicas
    a.admit("acme", 10, prompt_tokens=10, max_tokens=0)
    with pytest.raises(QuotaExceeded):
        b.admit("acme", 10, prompt_tokens=1, max_tokens=1)
    assert b.admit("globex", 10, prompt_tokens=1, max_tokens=1).charged == 2
    assert a.admit("acme", 0, prompt_tokens=10**6, max_tokens=1).window_key == ""  # no limit


def test_fails_open_without_redis() -> None:
    with EmbeddedRedis() as server:
        c = connect(server.url, timeout_s=0.5)
        quota = TokenQuota(c, "q-down")
        quota.admit("acme", 10, prompt_tokens=10, max_tokens=0)
    grant = quota.admit("acme", 10, prompt_tokens=10, max_tokens=0)  # server gone
    assert grant.window_key == "" and quota.fail_open == 1
    quota.settle(grant, 0)
    c.close()
