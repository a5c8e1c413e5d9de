"""Fixtures for router tests: one real embedded Redis per session, a fresh namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import cast

import pytest
import redis

from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry, WorkerInfo

MODEL = "model-fp"
LAYOUT = "layout-fp"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server
    assert not server.running()


@pytest.fixture(scope="session")
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = connect(redis_server.url, timeout_s=2.0)
    yield c
    c.close()


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def worker(worker_id: str, role: str = "mixed", **kw: object) -> WorkerInfo:
    fields: dict[str, object] = {"model": MODEL, "layout_fingerprint": LAYOUT}
    fields.update(kw)
    return WorkerInfo(worker_id, role, address=f"addr-{worker_id}", **fields)  # type: ignore[arg-type]


def register_pool(
    client: redis.Redis, namespace: str, role: str, n: int, ttl_s: float = 30.0
) -> list[WorkerInfo]:
    registry = Registry(client, Keyspace(namespace), ttl_s=ttl_s)
    infos = [worker(f"{role[0]}{i}", role) for i in range(n)]
    for info in infos:
        registry.register(info)
    return infos


def lease_expiries(client: redis.Redis, namespace: str, role: str) -> dict[str, float]:
    """Load lease id -> its expiry (Redis server ms) for every lease of a pool."""
    key = Keyspace(namespace).load(role)
    pairs = cast(list[tuple[str, float]], client.zrange(key, 0, -1, withscores=True))
    return dict(pairs)


def age_leases(client: redis.Redis, namespace: str, role: str, by_s: float) -> int:
    """Bring every load lease of a pool `by_s` seconds closer to its expiry, as if that
    much time had passed; returns how many leases moved.

    The test's clock: the Lua scripts read Redis's own TIME, which a test cannot stop or
    advance, so a test that waits out a short TTL races the host's scheduler. Leases are
    placed with TTLs far longer than any test and then aged here instead.
    """
    leases = lease_expiries(client, namespace, role)
    aged: dict[str, float] = {lease: at - by_s * 1000 for lease, at in leases.items()}
    if aged:
        client.zadd(Keyspace(namespace).load(role), dict(aged), xx=True)
    return len(aged)
