"""`RedisPlacement`: the gateway's `Placement` backed by the Redis router.

Lifecycle: `RedisPlacement.from_config(config)` connects to `config.redis_url` (or starts
an `EmbeddedRedis` and owns it when the URL is empty), builds a `Router`, and reads the
registry once. The gateway then awaits `route` (or `route_decode`, which places the decode
pool alone) and `release` per request; each runs the synchronous router in a worker thread
(redis-py's sync client is the one the Lua scripts and the tests share), and each finishes
its Redis work even if the caller is cancelled.
`close()` disconnects and stops an owned embedded server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import redis

from services.common.detached import done, in_thread
from services.router.embedded_redis import EmbeddedRedis
from services.router.placement import RouteDecision, RouteQuery, WorkerRef
from services.router.redis_client import connect
from services.router.router import Router, RouterStats
from services.router.router_config import RouterConfig


class RedisPlacement:
    """Implements `services.router.placement.Placement` with bounded-load hashing."""

    def __init__(self, router: Router, *, embedded: EmbeddedRedis | None = None) -> None:
        self.router = router
        self._embedded = embedded

    @classmethod
    def from_config(cls, config: RouterConfig) -> RedisPlacement:
        embedded = None
        url = config.redis_url
        if not url:
            embedded = EmbeddedRedis().start()
            url = embedded.url
        try:
            router = Router(connect(url, config.redis_timeout_s), config)
            router.refresh()
        except BaseException:
            if embedded is not None:
                embedded.close()
            raise
        return cls(router, embedded=embedded)

    @property
    def redis_url(self) -> str:
        """Where workers must register (the embedded server's URL when there is one)."""
        if self._embedded is not None:
            return self._embedded.url
        return self.router.config.redis_url

    @property
    def client(self) -> redis.Redis:
        return self.router.client

    @property
    def stats(self) -> RouterStats:
        return self.router.stats

    async def route(self, query: RouteQuery) -> RouteDecision:
        """Pick workers and lease their load; raises NoWorkerError (UNAVAILABLE).

        If the caller is cancelled meanwhile (its client went away), the router thread
        still finishes the placement, and its load leases are given back as soon as it
        does: the caller never sees the decision, so nobody else would release them.
        """
        return await self._placed(asyncio.to_thread(self.router.route, query))

    async def route_decode(self, query: RouteQuery) -> RouteDecision:
        """Pick a decode worker and lease its load alone; raises NoWorkerError. Cancelled,
        it gives back what it took once placed, as `route` does."""
        return await self._placed(asyncio.to_thread(self.router.route_decode, query))

    async def _placed(self, routing: Awaitable[RouteDecision]) -> RouteDecision:
        placing = asyncio.ensure_future(routing)
        try:
            return await asyncio.shield(placing)
        except asyncio.CancelledError:
            placing.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, placing: asyncio.Future[RouteDecision]) -> None:
        if placing.cancelled() or placing.exception() is not None:
            return
        self.release(placing.result())

    def release(self, decision: RouteDecision) -> Awaitable[None]:
        """Give back the decision's load leases; never raises on a dead Redis.

        The Redis round trip is handed to a thread here, at call time (the event loop
        must not block on it), and the returned awaitable only waits for it: cancelling
        the caller, even before it first awaits, never drops the job, which would leave
        the load counted until the lease TTL.
        """
        if not decision.load_lease_ids:
            return done()
        return in_thread(self.router.release, decision.load_lease_ids)

    def report_down(self, worker_id: str) -> Awaitable[None]:
        """Mark the worker down in the registry (`Router.report_down`), in a thread."""
        return in_thread(self.router.report_down, worker_id)

    def workers(self) -> list[WorkerRef]:
        return self.router.workers()

    def close(self) -> None:
        self.router.client.close()
        if self._embedded is not None:
            self._embedded.close()
            self._embedded = None
