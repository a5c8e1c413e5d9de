"""Waiting for room in a decode worker's KV pool for a request's imported KV.

Lifecycle: the `DecodeHandler` owns one `ImportRoom`. An import that finds the pool
short (the importer's `NoBlocksError`: it reserved nothing, and the prefill worker still
holds the KV under its lease) is tried again after `wait(ticket, until)`: until a stream
on this worker finishes (`freed()`: the engine freed its blocks in the step that ended
it) or `poll_s` passes, which covers blocks freed where no stream finishes (an abort
takes effect at the engine's next step, a failed import gives back its reservation).
`until(handle, deadline)` is the latest an import may wait: at most `max_wait_s`, and
never past the request's deadline or the KV lease's expiry less `lease_margin_s` (the
read itself needs the lease). Once it has passed the handler fails the call with
RESOURCE_EXHAUSTED, and the gateway places the decode side again: on another decode
worker, or on this one after a backoff.

Why a bounded wait here as well as the gateway's retry: a worker that is about to free
blocks (a request in its last tokens) takes the import within one step, without a round
trip; a worker that stays full lets go soon enough for the gateway to try another one.
Waiting holds nothing, so a cancel while waiting leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.v1 import common_pb2

MAX_WAIT_S = 2.0  # the longest one import waits here before the gateway looks elsewhere
POLL_S = 0.2  # how often a waiting import tries again when no stream finishes
LEASE_MARGIN_S = 1.0  # the KV lease must outlive the wait by this, for the read itself


@dataclass(frozen=True)
class RoomLimits:
    max_wait_s: float = MAX_WAIT_S
    poll_s: float = POLL_S
    lease_margin_s: float = LEASE_MARGIN_S

    def __post_init__(self) -> None:
        if min(self.max_wait_s, self.poll_s) <= 0 or self.lease_margin_s < 0:
            raise ValueError("max_wait_s and poll_s must be > 0, lease_margin_s >= 0")


class ImportRoom:
    """Wakes imports waiting for KV blocks when a stream on this worker finishes.

    Used on the event loop only. `clock` is monotonic seconds, `wall` Unix seconds (the
    KV lease's expiry is a Unix time set by the prefill worker).
    """

    def __init__(
        self,
        limits: RoomLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.limits = limits or RoomLimits()
        self._clock = clock
        self._wall = wall
        self._freed = asyncio.Event()

    def until(self, handle: common_pb2.KvHandle, request_deadline: float | None) -> float:
        """The latest (monotonic) an import of `handle` may wait for room."""
        now = self._clock()
        bounds = [now + self.limits.max_wait_s]
        if request_deadline is not None:
            bounds.append(request_deadline)
        if handle.lease_expiry_unix_ms:
            lease_left = handle.lease_expiry_unix_ms / 1000 - self._wall()
            bounds.append(now + lease_left - self.limits.lease_margin_s)
        return min(bounds)

    def ticket(self) -> asyncio.Event:
        """Take before trying to reserve: a stream that finishes during the try sets it."""
        return self._freed

    def freed(self) -> None:
        """A stream finished here: its blocks are free; wake every waiting import."""
        self._freed.set()
        self._freed = asyncio.Event()

    async def wait(self, ticket: asyncio.Event, until: float) -> bool:
        """Wait for a stream to finish or for the next poll; False, at once, when `until`
        has passed (the import is out of time)."""
        left = until - self._clock()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ticket.wait(), min(self.limits.poll_s, left))
        return True
