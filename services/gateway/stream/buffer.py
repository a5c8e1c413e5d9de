"""The bounded buffer between a request's relay and its client, and the slow-client rule.

Lifecycle: `GatewayService.stream` makes one `StreamBuffer` per admitted request and
`start`s it on the request's relay (`RequestStream.run`). A pump task reads the relay and
keeps up to `stream_buffer_messages` messages; the front door takes them (`next`) at the
pace its client reads. So the relay reads the decode stream at the worker's pace whatever
the client does, and no worker's batch waits for one client. The stream ends one of four
ways:

- the relay finishes: its messages wait until the client has taken them;
- the relay fails (a worker's status, the request's deadline): the record is closed at
  once, so both workers drop the request now, and the error follows the messages
  already buffered;
- the client stops reading: once messages have waited `slow_client_timeout_s` without
  the client taking one (the buffer full, or the relay over), the client is given up on.
  The error is thrown into the relay (whose telemetry records it), the record is closed
  (`RequestRecord.close`, the one cleanup path: decode stream cancelled, un-pulled KV
  aborted, slot, load leases and unused quota given back), and the front door's
  `disconnect` ends the client's call with RESOURCE_EXHAUSTED; a `next` still to come
  raises it. While the buffer is full, the request's deadline is watched here too, as
  the relay is not reading then;
- the client goes away: the front door stops taking, `stop` cancels the pump (which
  closes the relay), and whoever made the record closes it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeAlias

import grpc

from pdserve.v1 import gateway_pb2
from services.common.status import StatusError
from services.gateway.config import GatewayConfig
from services.gateway.stream.errors import StreamError, deadline_error
from services.gateway.stream.request_record import RequestRecord

log = logging.getLogger(__name__)

#: Ends the client's call with this error now, from outside the task serving it (which
#: is stuck writing to a client that does not read). Must not raise.
Disconnect = Callable[[StatusError], Awaitable[None]]
Relay = AsyncGenerator[gateway_pb2.GenerateResponse, None]


class _End:
    """The relay is over: the front door's `next` returns None."""


END = _End()
Item: TypeAlias = gateway_pb2.GenerateResponse | Exception | _End


def slow_client_error(waited_s: float, unread: int) -> StreamError:
    return StreamError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"slow_client_timeout_s: the client stopped reading (no message taken for "
        f"{waited_s:.1f}s, {unread} waiting); the request was aborted",
    )


class StreamBuffer:
    def __init__(
        self,
        record: RequestRecord,
        config: GatewayConfig,
        deadline: float,
        disconnect: Disconnect | None = None,
    ) -> None:
        """`deadline`: the request's end, on `time.monotonic()`."""
        self.record = record
        self.size = config.stream_buffer_messages
        self.stall_s = config.slow_client_timeout_s
        self.deadline_s = config.request_deadline_s
        self.deadline = deadline
        self._disconnect = disconnect
        self._items: collections.deque[Item] = collections.deque()
        self._added = asyncio.Event()  # the front door waits on it while the buffer is empty
        self._taken = asyncio.Event()  # the pump waits on it while the buffer is full
        self._since = 0.0  # when the client last took a message, or was handed one idle
        self._given_up: StreamError | None = None
        self._stopped = False
        self._last_word = False  # END or the relay's error is in the buffer
        self._pump: asyncio.Task[None] | None = None

    @property
    def gave_up_on_client(self) -> bool:
        """Whether the stream ended because its client stopped reading."""
        return self._given_up is not None

    def start(
        self,
        relay: Relay,
        on_message: Callable[[gateway_pb2.GenerateResponse], None] = lambda msg: None,
    ) -> None:
        """Pump `relay` into the buffer; `on_message` sees each message as it comes from
        the relay (not when the client reads it)."""
        self._on_message = on_message
        self._pump = asyncio.ensure_future(self._run(relay))
        self._pump.add_done_callback(self._pump_ended)

    def stop(self) -> None:
        """The client is gone: stop reading the relay (it is closed as the pump ends).
        The flag as well as the cancel: a cancel that lands as a relay's `wait_for`
        gets its result is swallowed there (Python 3.11), and the pump must not go on."""
        self._stopped = True
        self._taken.set()
        if self._pump is not None:
            self._pump.cancel()

    async def next(self) -> gateway_pb2.GenerateResponse | None:
        """The next message; None after the last; raises the relay's error, or the
        slow-client error once the client was given up on."""
        while not self._items and self._given_up is None:
            self._added.clear()
            await self._added.wait()
        if self._given_up is not None:
            raise self._given_up
        item = self._items.popleft()
        self._since = time.monotonic()
        self._taken.set()
        if isinstance(item, Exception):
            raise item
        return None if isinstance(item, _End) else item

    # -- the pump ------------------------------------------------------------------
    def _add(self, item: Item) -> None:
        if not self._items:
            self._since = time.monotonic()  # the client's clock starts with its first wait
        self._items.append(item)
        self._last_word = not isinstance(item, gateway_pb2.GenerateResponse)
        self._added.set()

    def _pump_ended(self, pump: asyncio.Task[None]) -> None:
        """A pump that died without a last word (cancelled from outside it, say a worker
        call torn down at shutdown, or a bug) must not leave the client waiting."""
        failure = None if pump.cancelled() else pump.exception()
        if failure is not None:
            log.warning("request %s: stream pump failed: %r", self.record.req.request_id, failure)
        if self._stopped or self._given_up is not None or self._last_word:
            return
        self.record.close()
        self._add(
            StreamError(grpc.StatusCode.INTERNAL, f"the gateway's relay failed: {failure!r}")
            if failure is not None
            else StreamError(grpc.StatusCode.CANCELLED, "the request was cancelled in the gateway")
        )

    async def _run(self, relay: Relay) -> None:
        try:
            async with contextlib.aclosing(_throwing(relay, self._backpressure)) as messages:
                async for msg in messages:
                    if self._stopped:
                        raise asyncio.CancelledError  # closes the relay on the way out
                    self._on_message(msg)
                    self._add(msg)
            self._add(END)
        except Exception as exc:
            # Both workers drop the request now; the client learns why in its turn.
            self.record.close()
            self._add(exc)  # the one item allowed past the bound: the client must see it
        while self._items and not self._stopped:  # the client has messages to take still
            if await self._wait_for_client(watch_deadline=False) is not None:
                await self._give_up()
                return

    async def _backpressure(self) -> StreamError | None:
        """After each message: while the buffer is full, wait for the client; the error
        to end the relay with if it is too slow, or the deadline passes meanwhile."""
        while len(self._items) >= self.size and not self._stopped:
            late = await self._wait_for_client(watch_deadline=True)
            if late is not None:
                return late
        return None

    async def _wait_for_client(self, *, watch_deadline: bool) -> StreamError | None:
        """Wait until the client takes a message; the error if it took none in time."""
        stall_at = self._since + self.stall_s
        limit = min(stall_at, self.deadline) if watch_deadline else stall_at
        self._taken.clear()
        try:
            await asyncio.wait_for(self._taken.wait(), max(0.0, limit - time.monotonic()))
            return None
        except TimeoutError:
            if limit < stall_at:
                return deadline_error(self.deadline_s)
            return slow_client_error(time.monotonic() - self._since, len(self._items))

    async def _give_up(self) -> None:
        unread = sum(isinstance(i, gateway_pb2.GenerateResponse) for i in self._items)
        self._given_up = slow_client_error(time.monotonic() - self._since, unread)
        self._items.clear()
        self._added.set()
        self.record.close()  # idempotent: a failed relay closed it already
        if self._disconnect is not None:
            await self._disconnect(self._given_up)


async def _throwing(
    relay: Relay, after_each: Callable[[], Awaitable[StreamError | None]]
) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
    """The relay's messages; after each one `after_each` may return an error, which is
    thrown into the relay where it stopped, so the relay ends (and records) it as its own
    failure. The relay is closed when this generator is."""
    try:
        msg = await anext(relay)
        while True:
            yield msg
            late = await after_each()
            msg = await (relay.athrow(late) if late is not None else anext(relay))
    except StopAsyncIteration:
        return
    finally:
        await relay.aclose()
