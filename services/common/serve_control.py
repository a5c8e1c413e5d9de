"""Running a service inside a host process that is not its launcher (a Ray actor).

A service run by `pdserve worker|gateway|router` is its own process: it announces its
address with a JSON line on stdout and stops on SIGTERM. A host that runs the same
serve function on one of its own threads (signal handlers exist only on the main thread)
needs both through an object instead.

Lifecycle: the host creates a `ServeControl`, sets it as the current control
(`use_control`) in the thread that runs the service's event loop, and runs the serve
coroutine there. `announce_ready` (services/common/grpc_server.py) hands the ready
fields to `control.ready`; `wait_for_shutdown_signal` waits on `control` instead of
installing signal handlers. From any thread the host calls `request_stop()`, and the
service drains and returns exactly as it would on SIGTERM. The current control lives in
a ContextVar, so it is per thread/task and the serve functions need no extra argument.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

_CURRENT: ContextVar[ServeControl | None] = ContextVar("pdserve_serve_control", default=None)


class ServeControl:
    """Thread-safe: `request_stop` and `ready` may be used from any thread."""

    def __init__(self) -> None:
        self.ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._stop_requested = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def announce(self, fields: Mapping[str, Any]) -> None:
        """Record the service's ready fields (its address first of all); first call wins."""
        if not self.ready.done():
            self.ready.set_result(dict(fields))

    def fail(self, exc: BaseException) -> None:
        """The service ended before it was ready: whoever waits on `ready` gets `exc`."""
        if not self.ready.done():
            self.ready.set_exception(exc)

    def request_stop(self) -> None:
        """Ask the service to drain and return, as SIGTERM would. Idempotent."""
        with self._lock:
            self._stop_requested = True
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    async def wait_stop(self) -> None:
        """Return once `request_stop` was called (before or during this wait)."""
        event = asyncio.Event()
        with self._lock:
            if self._stop_requested:
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        await event.wait()


def use_control(control: ServeControl) -> None:
    """Make `control` the current one in this context (call it in the service's thread)."""
    _CURRENT.set(control)


def current_control() -> ServeControl | None:
    return _CURRENT.get()
