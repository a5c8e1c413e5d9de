"""A worker's home role at run time: the planner's task, and the change itself.

Lifecycle: `HomeRole(...)` holds the role the worker started with; `attach(...)` gives it
the worker's registration, signal publisher and planner once they exist; `start()` (only
with a registry and `--role-window-s` > 0) starts a task that each `tick_s` reads every
worker's load signal from Redis (one round trip, off the event loop), feeds it to the
`RolePlanner` and, when the planner calls for a move and this worker wins the cluster's
one change per window (`Registry.claim_role_change`), changes role. `change(role,
reason)` is also what an operator's SetRole call runs. `stop()` ends the task.

A change, in order, under one lock:
1. `Phases.serve(role)`: the worker can run the new role's phase (it starts the KV
   exporter or importer the first time; nothing is stopped, so calls placed under the old
   role, by a router whose view is a refresh old, are still served);
2. the registration moves to the new role's pool (one atomic registry call; the
   heartbeat cannot undo it);
3. the load signal is published under the new role from its next publish on.
Nothing is drained or migrated: every role decodes, so the worker's streams go on where
they are, and its engine, prefix cache included, is untouched. A worker killed halfway
holds nothing another process must give back: its registration and signal expire, and
its streams fail over as after any worker crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

import redis

from services.common.role import Role
from services.engine_host.telemetry import WorkerTelemetry
from services.router.redis_client import REDIS_DOWN_ERRORS
from services.router.worker_signal import SignalBoard
from services.worker.phases import Phases
from services.worker.registration import WorkerRegistration
from services.worker.role_planner import Reading, RolePlanner
from services.worker.signal_publisher import SignalPublisher

log = logging.getLogger(__name__)

#: Seconds between the planner's readings of the cluster's signals.
TICK_S = 1.0
#: What a reading or a change raises when Redis is down or refuses: not a bug here.
_REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, *REDIS_DOWN_ERRORS)


class ChangeReason(enum.StrEnum):
    """Why a home role changed (a metric label)."""

    PLANNER = "planner"  # the mix stayed shifted for a window
    OPERATOR = "operator"  # a SetRole call


class HomeRole:
    """The worker's home role, and the one way to change it."""

    def __init__(self, role: Role, phases: Phases, telemetry: WorkerTelemetry) -> None:
        self.role = role
        self.phases = phases
        self.telemetry = telemetry
        # Set once the worker has them (`attach`): without a registration a change moves
        # nothing in Redis, without a planner nothing changes by itself.
        self.registration: WorkerRegistration | None = None
        self.publisher: SignalPublisher | None = None
        self.planner: RolePlanner | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def change(self, role: Role, reason: ChangeReason) -> Role:
        """Make `role` this worker's home role; returns the one it had. Redis errors
        propagate, with the role unchanged (the phases it started stay)."""
        async with self._lock:
            previous = self.role
            if role is previous:
                return previous
            await asyncio.to_thread(self.phases.serve, role)
            if self.registration is not None:
                await self.registration.change_role(role)
            if self.publisher is not None:
                self.publisher.role = role
            self.role = role
            if self.planner is not None:
                self.planner.reset()
            self.telemetry.count_role_change(previous, role, reason)
            log.info("home role %s -> %s (%s)", previous, role, reason)
            return previous

    def attach(
        self,
        registration: WorkerRegistration | None,
        publisher: SignalPublisher | None,
        planner: RolePlanner | None = None,
    ) -> HomeRole:
        """Give the role its registration and signal (a change moves both), and the
        planner that may change it (None: only SetRole does)."""
        self.registration, self.publisher, self.planner = registration, publisher, planner
        return self

    def start(self) -> HomeRole:
        """Start the planner's task (needs a registration, a publisher and a planner)."""
        parts = {"planner": self.planner, "registration": self.registration,
                 "publisher": self.publisher}  # fmt: skip
        missing = [name for name, part in parts.items() if part is None]
        if missing:  # a wiring bug: say which part, even under python -O
            raise RuntimeError(f"HomeRole.start needs its {', '.join(missing)}: attach them")
        self._task = asyncio.create_task(self._run(), name="home-role")
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
            self._task = None

    async def _run(self) -> None:
        assert self.planner is not None and self.publisher is not None
        board = self.publisher.board  # the one the worker publishes on: it reads there too
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=TICK_S)
            if self._stop.is_set():
                return
            try:
                await self._tick(board)
            except _REDIS_ERRORS as exc:  # a gap in the evidence: start the window over
                self.planner.reset()
                log.debug("role planner: no reading this tick: %s", exc)
            except Exception:  # a bug: say so, and keep the role (the worker still serves)
                log.exception("role planner tick failed; the home role stays %s", self.role)

    async def _tick(self, board: SignalBoard) -> None:
        assert self.planner is not None and self.registration is not None
        signals = await asyncio.to_thread(board.read, [Role.PREFILL, Role.DECODE])
        now = self.clock()
        self.planner.observe(self.role, Reading(now, signals, self.phases.prefill_calls))
        target = self.planner.want(self.role, now)
        if target is None:
            return
        registry, me = self.registration.registry, self.registration.info.worker_id
        if await asyncio.to_thread(registry.claim_role_change, me, self.planner.window_s):
            await self.change(target, ChangeReason.PLANNER)
