from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from services.common.detached import Detached, done, in_thread, undone_if_cancelled


def test_in_thread_runs_although_cancelled_before_the_loop_turns() -> None:
    ran = threading.Event()

    async def go() -> None:
        waiting = asyncio.gather(in_thread(ran.set))
        waiting.cancel()  # the awaiter goes before anything has run
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(go())  # waits for the executor's queued jobs on the way out
    assert ran.is_set()


def test_a_cancelled_call_is_undone_once_it_ends_and_an_awaited_one_is_not() -> None:
    release = threading.Event()
    undone: list[str] = []

    def take(name: str) -> str:
        release.wait(5)
        return name

    async def go() -> None:
        def undo(job: asyncio.Future[str]) -> None:
            undone.append(job.result())

        kept = await undone_if_cancelled(lambda: "kept", undo=undo)
        caller = asyncio.ensure_future(undone_if_cancelled(take, "lease-1", undo=undo))
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert undone == [] and kept == "kept"  # the call is still running
        release.set()
        for _ in range(100):
            if undone:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert undone == ["lease-1"]


def test_finish_runs_the_work_to_its_end_after_its_awaiter_is_cancelled() -> None:
    steps: list[str] = []

    async def cleanup() -> None:
        steps.append("start")
        await asyncio.sleep(0.05)  # where a second cancel of the caller would cut it
        steps.append("end")

    async def go() -> None:
        detached = Detached()
        caller = asyncio.ensure_future(detached.finish(cleanup()))
        await asyncio.sleep(0.01)
        caller.cancel()
        caller.cancel()  # twice, as a torn-down RPC may
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert len(detached) == 1
        await detached.close(timeout_s=5.0)
        assert len(detached) == 0

    asyncio.run(go())
    assert steps == ["start", "end"]


def test_close_cancels_what_outlasts_the_grace() -> None:
    async def go() -> None:
        detached = Detached()
        slow = detached.finish(asyncio.sleep(60))
        await detached.close(timeout_s=0.05)
        assert len(detached) == 0
        with pytest.raises(asyncio.CancelledError):
            await slow

    asyncio.run(go())


def test_a_failure_nobody_awaits_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("redis gone")

    async def go() -> None:
        detached = Detached()
        caller = asyncio.ensure_future(detached.finish(broken()))
        caller.cancel()
        await detached.close(timeout_s=1.0)
        assert await done() is None

    with caplog.at_level(logging.WARNING, logger="services.common.detached"):
        asyncio.run(go())
    assert "detached cleanup failed: RuntimeError('redis gone')" in caplog.text
