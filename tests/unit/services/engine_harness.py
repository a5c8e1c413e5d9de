"""Worker handlers on a real engine whose steps the test lets through one at a time.

`Stepper` wraps an engine's `step` so the engine loop's thread takes a step only when
the test allows it (`allow`), and can hold a step's outputs back before the loop hands
them to the handler (`hold_outputs`): a handler can then be cancelled at a chosen await
with the engine in a chosen state. `drained` lets the engine run freely until it has
nothing left to do, which is when a leak check can look at it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.engine import LLMEngine
from engine.request import RequestOutput
from services.engine_host.loop import EngineLoop

WAIT_S = 30.0  # a step the test never allows goes ahead after this: no test hangs


class Stepper:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._real = engine.step
        self._cond = threading.Condition()
        self._allowed = 0
        self._free = False
        self._released = 0
        self.hold_outputs = False
        self.taken = 0
        engine.step = self._step  # type: ignore[method-assign]

    def _step(self) -> list[RequestOutput]:
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._allowed > 0, timeout=WAIT_S)
            self._allowed = max(0, self._allowed - 1)
        outputs = self._real()
        with self._cond:
            self.taken += 1
            self._cond.notify_all()
            if self.hold_outputs:
                self._cond.wait_for(
                    lambda: self._free or self._released >= self.taken, timeout=WAIT_S
                )
        return outputs

    def allow(self, steps: int = 1) -> None:
        with self._cond:
            self._allowed += steps
            self._cond.notify_all()

    def release_outputs(self) -> None:
        with self._cond:
            self._released = self.taken
            self._cond.notify_all()

    def free(self) -> None:
        with self._cond:
            self._free = True
            self._cond.notify_all()

    async def taken_at_least(self, steps: int) -> None:
        def wait() -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: self.taken >= steps, timeout=WAIT_S)

        assert await asyncio.to_thread(wait), f"the engine never took {steps} step(s)"

    def restore(self) -> None:
        self.free()
        del self.engine.step  # the class's method again


class Harness:
    """An engine, its loop thread on this event loop, and its stepper."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stepper = Stepper(engine)
        self.loop = EngineLoop(engine).start(asyncio.get_running_loop())

    async def drained(self) -> None:
        """Let the engine run until it has nothing left (aborts processed, blocks freed)."""
        self.stepper.free()
        self.loop.wake()
        await until(lambda: not self.engine.has_unfinished())

    def close(self) -> None:
        self.stepper.restore()
        self.loop.stop()


async def until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class ThreadHold:
    """Holds calls to a blocking function (run in a worker thread) before or after the
    real call, until the test lets them go."""

    def __init__(self, fn: Callable[..., Any], *, after: bool) -> None:
        self._fn = fn
        self._after = after
        self.arrived = threading.Event()
        self.proceed = threading.Event()
        self.returned = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if not self._after:
                self.arrived.set()
                self.proceed.wait(timeout=WAIT_S)
            result = self._fn(*args, **kwargs)
            if self._after:
                self.arrived.set()
                self.proceed.wait(timeout=WAIT_S)
            return result
        finally:
            self.returned.set()

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.arrived.wait, WAIT_S), "the call never came"

    async def done(self) -> None:
        assert await asyncio.to_thread(self.returned.wait, WAIT_S), "the call never returned"


class CallLog:
    """Records the arguments of every call to a function and passes them on."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> Any:
        self.calls.append(args)
        return self._fn(*args)


class Context:
    """The part of grpc.aio.ServicerContext the handlers read (no caller trace)."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return ()

    def time_remaining(self) -> float | None:
        return None  # no gRPC deadline
