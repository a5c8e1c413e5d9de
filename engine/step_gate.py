"""The engine's step lock, and calls from other threads that must not race a step.

Lifecycle of a call: a thread hands `fn` to `run_or_defer` (never waits) or
`between_steps` (waits for and returns its result). If no step holds the lock, `fn`
runs at once on the caller; otherwise it is queued and the stepping thread runs it,
through `run_deferred`, first thing in its next step. A thread that simply contended for
the lock could lose it to the stepping thread step after step, and on a prefill worker
one step of a long prompt lasts seconds. If nothing steps any more (no thread started,
or it stopped), a `between_steps` caller runs its own queued call once the lock is free.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How often a waiting `between_steps` caller checks whether anything still steps.
POLL_S = 0.05


class StepGate:
    """The lock one step holds from start to end, plus the queue of deferred calls."""

    def __init__(self) -> None:
        # Reentrant: a deferred call may itself call run_or_defer or between_steps.
        self.lock = threading.RLock()
        self._queue_lock = threading.Lock()  # guards only `_calls`: never held for a step
        self._calls: list[Callable[[], None]] = []

    def run_or_defer(self, fn: Callable[[], None]) -> None:
        """Run `fn` under the lock: now if no step holds it, else first thing in the next
        step. Never waits, so an event loop may call it; `fn`'s errors are logged."""
        if self.lock.acquire(blocking=False):
            try:
                _logged(fn)
            finally:
                self.lock.release()
            return
        with self._queue_lock:
            self._calls.append(fn)

    def between_steps(self, fn: Callable[[], T]) -> T:
        """Run `fn` under the lock and return its result (or raise its error).

        Waits at most for the step in flight, or, when no thread steps, for the lock.
        """
        done: Future[T] = Future()

        def call() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                done.set_exception(exc)

        self.run_or_defer(call)
        while True:
            try:
                return done.result(timeout=POLL_S)
            except TimeoutError:
                self._run_if_still_queued(call)

    def has_deferred(self) -> bool:
        with self._queue_lock:
            return bool(self._calls)

    def run_deferred(self) -> None:
        """Run every queued call; the stepping thread calls it holding the lock."""
        with self._queue_lock:
            calls, self._calls = self._calls, []
        for call in calls:
            _logged(call)

    def _run_if_still_queued(self, call: Callable[[], None]) -> None:
        if not self.lock.acquire(blocking=False):
            return
        try:
            with self._queue_lock:
                queued = call in self._calls
                if queued:
                    self._calls.remove(call)
            if queued:
                call()
        finally:
            self.lock.release()


def _logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        log.exception("deferred engine call failed")
