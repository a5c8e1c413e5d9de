"""Redis clients the router and registry use: decoded strings, short timeouts, no retries.

The router fails open on the first connection error rather than retrying inside the
client (redis-py retries with backoff by default, which would turn one dead Redis into
seconds of added latency per request); `Router` decides when to try Redis again.

A `redis+sentinel://[:password@]host:port,host:port,.../service[/db]` URL names Sentinels
instead of a server: the client asks them for the service's primary on every new
connection (redis-py's `Sentinel.master_for`), so after a failover the first call fails,
the caller fails open as for any outage, and its next connection reaches the new primary.
A connection still open to a demoted primary is dropped on its first READONLY reply.
The password, if any, is the data servers'; the Sentinels are asked without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool


def router_script(client: redis.Redis, name: str) -> Script:
    """The Lua script `name` of this package, registered on `client` (sent by SHA, loaded
    on first use)."""
    text = resources.files("services.router").joinpath(name).read_text(encoding="utf-8")
    return client.register_script(text)


#: What the router treats as "Redis is unreachable": route locally, try again later.
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelUrl:
    """The parts of a `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str = ""

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        parts = urlsplit(url)
        if parts.scheme != SENTINEL_SCHEME:
            raise ValueError(f"not a {SENTINEL_SCHEME}:// URL: {url!r}")
        auth, _, hosts = parts.netloc.rpartition("@")
        password = unquote(auth.partition(":")[2]) if auth else ""
        sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h)
        path = [p for p in parts.path.split("/") if p]
        if not sentinels or not path or len(path) > 2:
            raise ValueError(
                f"redis_url {url!r}: expected {SENTINEL_SCHEME}://host:port[,host:port...]"
                "/service[/db]"
            )
        db = path[1] if len(path) == 2 else "0"
        if not db.isdigit():
            raise ValueError(f"redis_url {url!r}: db must be a number, got {db!r}")
        return cls(sentinels, unquote(path[0]), int(db), password)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"redis_url {url!r}: Sentinel address {text!r} is not host:port")
    return host, int(port)


def connect(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client for `url` (redis://, rediss://, unix:// or redis+sentinel://) that
    returns str, not bytes."""
    if not url:
        raise ValueError("a Redis URL is needed (start EmbeddedRedis for a local one)")
    options = {
        "decode_responses": True,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        return _primary_of(SentinelUrl.parse(url), options, timeout_s)
    return redis.Redis.from_url(url, **options)


def _primary_of(target: SentinelUrl, options: dict[str, object], timeout_s: float) -> redis.Redis:
    asking = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=asking)
    password = target.password or None
    return sentinel.master_for(target.service, db=target.db, password=password, **options)


def is_replicated(client: redis.Redis) -> bool:
    """Whether `client` reaches its data through Sentinel (a primary with replicas)."""
    return isinstance(client.connection_pool, SentinelConnectionPool)


def reached_a_replica(client: redis.Redis, timeout_ms: int = 250) -> bool:
    """After a write that must outlive the primary (a rollout's phase): wait until a
    replica has it (WAIT 1). True at once without Sentinel (nothing to wait for);
    False if no replica acknowledged within `timeout_ms`, which is kept under the
    client's socket timeout of 0.5 s."""
    if not is_replicated(client):
        return True
    return int(client.wait(1, timeout_ms)) >= 1
