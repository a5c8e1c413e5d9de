"""Work that must run to its end even when whoever started it is cancelled.

The gateway gives back what a request held (load leases, the prefill worker's KV lease,
unused quota: see `services.gateway.stream.request_record`) when the request's task ends, and
that task can be cancelled again while it cleans up (the client's RPC torn down,
sometimes twice in one loop turn). Anything cut short there stays held until its TTL.
Two tools keep a cancel from cutting it short:

- `in_thread(fn, *args)` hands a blocking call (a Redis round trip) to the default
  executor at once, at call time, and returns an awaitable that only waits for it. A
  coroutine doing the same would not start until its first step, and a cancel that lands
  before that step drops it unseen.
- `undone_if_cancelled(fn, *args, undo=...)` runs a blocking call that takes something
  (a worker's KV import, its export's lease) in a thread and waits for it; if the
  awaiter is cancelled, the call still runs to its end and then `undo` gives back what
  it took, since nobody is left to use it.
- `Detached.finish(coro)` runs a coroutine as its own task, held until it ends (the
  loop keeps only weak references to tasks), and returns an awaitable that only waits
  (`start` returns the task itself, for a caller that awaits it more than once);
  `close` gives the unfinished ones a moment at shutdown, then cancels them.

`done()` is the finished awaitable for the nothing-to-do branch of either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def done() -> asyncio.Future[None]:
    """An already finished awaitable (nothing to do)."""
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    finished.set_result(None)
    return finished


def in_thread(fn: Callable[..., T], *args: Any) -> Awaitable[T]:
    """Start `fn(*args)` in the default executor now; cancelling the awaiter leaves it
    running (the job is queued before this returns)."""
    return asyncio.shield(asyncio.get_running_loop().run_in_executor(None, fn, *args))


async def undone_if_cancelled(
    fn: Callable[..., T], *args: Any, undo: Callable[[asyncio.Future[T]], None]
) -> T:
    """`fn(*args)` in a thread (with this task's context), awaited. When the await is
    cancelled the thread cannot be stopped: `undo(its future)` runs on the loop once it
    is done, succeeded or not."""
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(undo)
        raise


class Detached:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `work` as its own task to its end, held here until it ends. Await it only
        through `asyncio.shield` (an await cancelled directly cancels the task)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def finish(self, work: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """`start` `work`; awaiting the result waits for it, and cancelling that await
        does not cancel the work."""
        return asyncio.shield(self.start(work))

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Its awaiter may be gone; an error here must still be seen.
            log.warning("detached cleanup failed: %r", task.exception())

    async def close(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for unfinished work, then cancel what is left."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
