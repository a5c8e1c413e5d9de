"""Fixtures the gateway's unit tests share: a real embedded Redis per test module, a
client on it, and a fresh key namespace per test so tests never see each other's keys."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_client import connect


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = connect(redis_server.url, timeout_s=2.0)
    yield c
    c.close()


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"
