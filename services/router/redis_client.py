"""Redis clients the router and registry use: decoded strings, short timeouts, no retries.

The router fails open on the first connection error rather than retrying inside the
client (redis-py retries with backoff by default, which would turn one dead Redis into
seconds of added latency per request); `Router` decides when to try Redis again.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

#: What the router treats as "Redis is unreachable": route locally, try again later.
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)


def connect(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client for `url` (redis://, rediss:// or unix://) that returns str, not bytes."""
    if not url:
        raise ValueError("a Redis URL is needed (start EmbeddedRedis for a local one)")
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
