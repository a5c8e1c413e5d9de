"""`ImportRoom`, the decode worker's wait for KV blocks: how long an import may wait
(its cap, the request's deadline, the KV lease less a margin), and that a finished
stream wakes every waiting import at once while a wait with no free ends at the poll."""

from __future__ import annotations

import asyncio

from pdserve.v1 import common_pb2
from services.decode.import_room import ImportRoom, RoomLimits

NOW, WALL = 100.0, 1_700_000_000.0
LIMITS = RoomLimits(max_wait_s=2.0, poll_s=0.05, lease_margin_s=1.0)


def room(now: float = NOW) -> ImportRoom:
    return ImportRoom(LIMITS, clock=lambda: now, wall=lambda: WALL)


def handle(lease_left_s: float | None) -> common_pb2.KvHandle:
    if lease_left_s is None:
        return common_pb2.KvHandle()
    return common_pb2.KvHandle(lease_expiry_unix_ms=int((WALL + lease_left_s) * 1000))


def test_the_wait_is_bounded_by_its_cap_the_deadline_and_the_lease() -> None:
    r = room()
    assert r.until(handle(None), None) == NOW + 2.0
    assert r.until(handle(30.0), NOW + 60.0) == NOW + 2.0
    assert r.until(handle(30.0), NOW + 0.5) == NOW + 0.5
    assert r.until(handle(2.5), None) == NOW + 1.5


def test_a_wait_past_its_bound_returns_at_once() -> None:
    async def scenario() -> None:
        r = room()
        assert await r.wait(r.ticket(), NOW) is False

    asyncio.run(scenario())


def test_a_finished_stream_wakes_every_waiting_import() -> None:
    async def scenario() -> None:
        r = ImportRoom(RoomLimits(max_wait_s=60.0, poll_s=60.0))
        ticket = r.ticket()
        until = r.until(handle(None), None)
        waiters = [asyncio.create_task(r.wait(ticket, until)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters)
        r.freed()
        assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [True] * 3
        assert r.ticket() is not ticket  # a new round: the next free wakes the next waits

    asyncio.run(scenario())


def test_a_free_between_the_try_and_the_wait_is_not_missed() -> None:
    async def scenario() -> None:
        r = ImportRoom(RoomLimits(max_wait_s=60.0, poll_s=60.0))
        ticket = r.ticket()  # taken before the try
        r.freed()  # a stream finished while the import was trying
        assert await asyncio.wait_for(r.wait(ticket, r.until(handle(None), None)), 5)

    asyncio.run(scenario())


def test_without_a_free_the_wait_ends_at_the_poll() -> None:
    async def scenario() -> None:
        r = ImportRoom(LIMITS)
        assert await asyncio.wait_for(r.wait(r.ticket(), r.until(handle(None), None)), 5)

    asyncio.run(scenario())
