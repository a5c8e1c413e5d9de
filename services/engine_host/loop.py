"""Runs one engine on its own thread and fans its outputs out to asyncio streams.

Lifecycle: `EngineLoop(engine).start(loop)` starts the stepping thread. A handler calls
`open(request_id)` to get an asyncio queue *before* the request can produce output
(before `engine.add_request`, or before an import commits the request), then reads
`RequestOutput`s until one is finished; `close(request_id)` drops the queue (and aborts
the request if it is still live: closing a stream is a cancel). The thread steps while
the engine has work and sleeps on an event otherwise; `wake()` is called after anything
that gives it work. `stop()` ends the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from engine.engine import LLMEngine
from engine.finish_reason import FinishReason
from engine.request import RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> EngineLoop:
        self._loop = loop
        self._thread.start()
        return self

    def open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            self._queues[request_id] = queue
        return queue

    def close(self, request_id: str, *, finished: bool) -> None:
        with self._lock:
            self._queues.pop(request_id, None)
        if not finished:
            self.engine.abort(request_id)
            self.wake()

    def wake(self) -> None:
        self._work.set()

    def stop(self) -> None:
        self._stopped.set()
        self._work.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self.engine.has_unfinished():
                self._work.wait(0.05)
                self._work.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing every live request")
                outputs = self._fail_all(exc)
            self._dispatch(outputs)

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        """A step that raised would raise again: end every stream with the error rather
        than leave its client hanging, and abort the requests so their blocks free."""
        with self._lock:
            ids = list(self._queues)
        for rid in ids:
            self.engine.abort(rid)
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        return [RequestOutput(rid, [], True, FinishReason.ABORT, error=message) for rid in ids]

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        for out in outputs:
            with self._lock:
                queue = self._queues.get(out.request_id)
            if queue is not None:
                self._loop.call_soon_threadsafe(queue.put_nowait, out)
