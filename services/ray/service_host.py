"""One pdserve service run on a private thread and event loop of the current process.

Lifecycle: `ServiceHost(name, make_coroutine).start()` starts a thread that makes the
service's `ServeControl` current and runs `make_coroutine()` (a serve function:
`serve_worker`, `serve_gateway`, `serve_router`) under `asyncio.run`. `wait_ready()`
returns the fields the service announced (its address) or raises what stopped it from
getting there. `stop()` asks it to drain and return, as SIGTERM would, and joins the
thread. `done` is set when the service returned or failed, stopped or not, so a host
can tell a crash (done without `stop`) from a shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from services.common.serve_control import ServeControl, use_control

log = logging.getLogger(__name__)

ServeFactory = Callable[[], Coroutine[Any, Any, None]]


class ServiceHost:
    def __init__(self, name: str, make_coroutine: ServeFactory) -> None:
        self.name = name
        self.control = ServeControl()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._make = make_coroutine
        self._thread = threading.Thread(target=self._run, name=f"pdserve-{name}", daemon=True)

    def start(self) -> ServiceHost:
        self._thread.start()
        return self

    def _run(self) -> None:
        use_control(self.control)  # a new thread starts with an empty context
        try:
            asyncio.run(self._make())
        except BaseException as exc:  # reported through `error`/`ready`; the thread ends
            self.error = exc
            log.exception("service %s failed", self.name)
            self.control.fail(exc)
        finally:
            self.control.fail(RuntimeError(f"service {self.name} exited before it was ready"))
            self.done.set()

    @property
    def crashed(self) -> bool:
        """Ended on its own: failed, or returned without being asked to stop."""
        return self.done.is_set() and not self.control.stop_requested

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """The ready fields (`ready` is the address); raises the service's own error."""
        return self.control.ready.result(timeout=timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """Drain and stop; True if the service returned within `timeout_s`."""
        self.control.request_stop()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
