"""A worker's registration with the Redis router: register, heartbeat, drain, leave.

Lifecycle: `WorkerRegistration.start()` registers the worker (an incompatible model or
KV layout raises IncompatibleWorkerError: the worker must not serve) and starts the
heartbeat task, which renews the lease and re-creates it after a Redis restart. Each
beat sends the registration as of then (`current`): the LoRA adapters resident on the
worker change, and the router prefers workers that hold a request's adapter. On
shutdown the worker calls `drain()` (routers stop placing on it at once), finishes its
streams, then `stop()` ends the heartbeat and deregisters. A worker that dies simply
stops heartbeating and expires after `heartbeat_ttl_s`. `change_role(role)` moves the
registration to another pool at run time (one atomic registry call; beats and the change
take one lock, so a beat that read the old role cannot move it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace

from services.common.role import Role
from services.router.keyspace import Keyspace
from services.router.redis_client import REDIS_DOWN_ERRORS, connect
from services.router.registry import Registry, WorkerInfo, keep_registered

log = logging.getLogger(__name__)


class WorkerRegistration:
    def __init__(
        self,
        redis_url: str,
        namespace: str,
        ttl_s: float,
        info: WorkerInfo,
        adapters: Callable[[], tuple[str, ...]] = tuple,
    ) -> None:
        self.info = info
        self.adapters = adapters  # the LoRA adapters resident now, sent with each beat
        self.registry = Registry(connect(redis_url, 1.0), Keyspace(namespace), ttl_s=ttl_s)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()  # one registry write at a time: beat or role change

    async def start(self) -> None:
        await asyncio.to_thread(self.registry.register, self.current())
        self._task = asyncio.create_task(
            keep_registered(self.registry, self.current, self._stop, lock=self._writing)
        )

    async def change_role(self, role: Role) -> None:
        """Register under `role` from now on: the routers find this worker in that pool
        at their next membership read. Redis errors propagate (the role is then
        unchanged here; Redis may or may not have moved it, and the next beat settles
        it either way)."""
        async with self._writing:
            await asyncio.to_thread(self.registry.register, replace(self.current(), role=role))
            self.info = replace(self.info, role=role)

    def current(self) -> WorkerInfo:
        """The registration as of now (its resident adapters change)."""
        return replace(self.info, adapters=self.adapters())

    async def drain(self) -> None:
        try:
            await asyncio.to_thread(self.registry.set_draining, self.info.worker_id)
        except REDIS_DOWN_ERRORS as exc:
            log.warning("could not mark %s draining: %s", self.info.worker_id, exc)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        try:
            await asyncio.to_thread(self.registry.deregister, self.info.worker_id)
        except REDIS_DOWN_ERRORS as exc:
            log.warning("could not deregister %s (it will expire): %s", self.info.worker_id, exc)
