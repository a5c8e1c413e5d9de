"""The admission controller alone, on signals from a fake board: at once when there is
room, a wait when there is not, refusals with retry hints at the budget or when the room
is full, class order, and nothing left counted after a cancel."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import replace
from typing import Any

import pytest

from engine.priority import Priority
from engine.stats import ClassCounts
from services.common.role import Role
from services.common.status import Overloaded, RefusalReason
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission import Admission
from services.gateway.flow.capacity import Cost
from services.gateway.flow.fair_share import FairView, TenantService
from services.router.worker_signal import WorkerSignal

# Run alone (`make test`'s serial phase): waits measured to tens of milliseconds.
pytestmark = pytest.mark.serial

CRIT, STD, SHED = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


class FakeBoard:
    """Signals of one prefill and one decode worker; `queued` prompt tokens wait."""

    def __init__(self, queued: int = 0, rate: float = 1000.0) -> None:
        self.queued = queued
        self.rate = rate

    def read(self, roles: Iterable[Role]) -> list[WorkerSignal]:
        waiting = ClassCounts(critical=self.queued)  # ahead of every class
        common = dict(waiting=0, running=0, total_blocks=1000, block_size=16, decode_step_s=0.02)
        return [
            WorkerSignal("p", Role.PREFILL, waiting, free_blocks=1000,
                         prefill_tokens_per_s=self.rate, **common),  # type: ignore[arg-type]
            WorkerSignal("d", Role.DECODE, ClassCounts(), free_blocks=1000,
                         prefill_tokens_per_s=0.0, **common),  # type: ignore[arg-type]
        ]  # fmt: skip


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on its own event loop."""

    @functools.wraps(test)
    def sync() -> None:
        asyncio.run(test())

    return sync


def config(**kw: object) -> GatewayConfig:
    base: dict[str, object] = dict(
        decode_workers="127.0.0.1:1",
        ttft_budget_critical_s=1.0,
        ttft_budget_standard_s=0.4,
        ttft_budget_sheddable_s=0.2,
        waiting_room_size=4,
    )
    base.update(kw)
    return GatewayConfig(**base)  # type: ignore[arg-type]


async def started(board: FakeBoard, **kw: object) -> Admission:
    admission = Admission(config(**kw), board)  # type: ignore[arg-type]
    admission.start(lambda: ())
    await asyncio.sleep(0.15)  # one signal read
    assert admission.signalled
    return admission


@run
async def test_admitted_at_once_when_it_fits() -> None:
    admission = await started(FakeBoard(queued=0))
    t0 = time.monotonic()
    granted = await admission.admit(STD, "a", 1.0, Cost(100, 10))
    assert granted is not None and time.monotonic() - t0 < 0.05
    assert admission.capacity.pending == 1
    granted.settled = True
    await admission.close()


@run
async def test_refused_at_its_budget_with_a_hint() -> None:
    board = FakeBoard(queued=5000)  # 5 s of prefill ahead: nothing fits a 0.4 s budget
    admission = await started(board)
    t0 = time.monotonic()
    with pytest.raises(Overloaded, match="standard request refused") as err:
        await admission.admit(STD, "a", 1.0, Cost(100, 10))
    waited = time.monotonic() - t0
    assert 0.4 <= waited < 0.4 + 0.2  # the end of its budget, not later
    assert err.value.reason is RefusalReason.BUDGET and err.value.retry_after_s >= 1
    assert len(admission.room) == 0
    await admission.close()


@run
async def test_waits_then_starts_when_capacity_frees() -> None:
    board = FakeBoard(queued=5000)
    admission = await started(board)
    waiting = asyncio.create_task(admission.admit(CRIT, "a", 1.0, Cost(100, 10)))
    await asyncio.sleep(0.2)
    assert not waiting.done() and len(admission.room) == 1
    board.queued = 0
    granted = await asyncio.wait_for(waiting, 1.0)
    assert granted is not None and len(admission.room) == 0
    await admission.close()


@run
async def test_full_room_refuses_at_once_lowest_class_first() -> None:
    admission = await started(FakeBoard(queued=5000), waiting_room_size=2)
    low = [asyncio.create_task(admission.admit(SHED, "a", 1.0, Cost(10, 1))) for _ in range(2)]
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as same:
        await admission.admit(SHED, "a", 1.0, Cost(10, 1))
    assert same.value.reason is RefusalReason.ROOM_FULL and time.monotonic() - t0 < 0.05
    crit = asyncio.create_task(admission.admit(CRIT, "b", 1.0, Cost(10, 1)))
    await asyncio.sleep(0.01)
    displaced = [t for t in low if t.done()]
    assert len(displaced) == 1 and isinstance(displaced[0].exception(), Overloaded)
    assert displaced[0].exception().reason is RefusalReason.DISPLACED  # type: ignore[union-attr]
    assert not crit.done()
    for t in [crit, *low]:
        t.cancel()
    await asyncio.gather(crit, *low, return_exceptions=True)
    assert len(admission.room) == 0
    await admission.close()


@run
async def test_cancel_while_waiting_leaves_nothing() -> None:
    board = FakeBoard(queued=5000)
    admission = await started(board, ttft_budget_critical_s=5.0)
    waiting = asyncio.create_task(admission.admit(CRIT, "a", 1.0, Cost(100, 10)))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    board.queued = 0
    await asyncio.sleep(0.2)
    assert len(admission.room) == 0 and admission.capacity.pending == 0
    await admission.close()


@run
async def test_off_without_a_board() -> None:
    admission = Admission(config())
    assert await admission.admit(STD, "a", 1.0, Cost(100, 10)) is None


@run
async def test_a_tenant_over_its_share_does_not_skip_the_room() -> None:
    admission = await started(FakeBoard(queued=0))
    admission.view = FairView(
        {STD: {"heavy": TenantService(10.0, True), "light": TenantService(1.0, True)}}
    )
    granted = await admission.admit(STD, "light", 1.0, Cost(100, 10))  # under its share
    assert granted is not None
    held = asyncio.create_task(admission.admit(STD, "heavy", 1.0, Cost(100, 10)))
    await asyncio.sleep(0.1)
    assert not held.done() and admission.room.tenants(STD) == ["heavy"]
    admission.view = FairView()  # light is no longer waiting anywhere: heavy may go
    assert await asyncio.wait_for(held, 1.0) is not None
    await admission.close()


@run
async def test_the_backlog_waits_here_not_in_the_engines() -> None:
    """Within its budget is not enough: a request that would queue more than the target
    behind others waits in the room (where class and fairness order it)."""
    board = FakeBoard(queued=3000)  # 3 s ahead: within a 20 s budget, past the target
    admission = await started(board, ttft_budget_critical_s=20.0)
    waiting = asyncio.create_task(admission.admit(CRIT, "a", 1.0, Cost(100, 10)))
    await asyncio.sleep(0.2)
    assert not waiting.done() and len(admission.room) == 1
    board.queued = 500  # 0.6 s ahead: within an idle pool's 0.1 s plus the 1 s target
    assert await asyncio.wait_for(waiting, 1.0) is not None
    await admission.close()


@run
async def test_a_prompt_longer_than_its_budget_is_served_by_an_idle_pool() -> None:
    """2 s of prefill on an idle pool starts at once under a 0.4 s budget (a tenth of the
    budget is the least any request may wait); with a second of work ahead of it, it
    waits, and is refused at its budget."""
    board = FakeBoard(queued=0)  # 1,000 tokens/s
    admission = await started(board)
    t0 = time.monotonic()
    granted = await admission.admit(STD, "a", 1.0, Cost(2000, 10))
    assert granted is not None and time.monotonic() - t0 < 0.05
    granted.settled = True
    board.queued = 1000  # 1 s of prefill ahead of it: past 90% of 0.4 s
    await asyncio.sleep(0.15)  # the next signal read
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as err:
        await admission.admit(STD, "a", 1.0, Cost(2000, 10))
    assert err.value.reason is RefusalReason.BUDGET
    assert 0.4 <= time.monotonic() - t0 < 0.4 + 0.2
    await admission.close()


@run
async def test_a_long_prompt_waiting_holds_its_class_back_only_briefly() -> None:
    """The room starts its class in order, so a waiting request holds back the ones
    behind it; a prompt that only an idle pool could start in time waits a tenth of
    its budget, then steps aside (and is refused at its budget), and the short request
    behind it starts."""
    board = FakeBoard(queued=200)  # 0.2 s ahead
    admission = await started(board, ttft_budget_standard_s=1.0)
    t0 = time.monotonic()
    long = asyncio.create_task(admission.admit(STD, "a", 1.0, Cost(2000, 10)))  # 2 s alone
    await asyncio.sleep(0.01)
    assert not long.done() and len(admission.room) == 1
    short = await asyncio.wait_for(admission.admit(STD, "b", 1.0, Cost(100, 10)), 1.0)
    assert short is not None and time.monotonic() - t0 < 0.3  # not the long one's 1 s
    short.settled = True
    with pytest.raises(Overloaded):
        await long
    assert 1.0 <= time.monotonic() - t0 < 1.2
    await admission.close()


class DecodeBoard(FakeBoard):
    """No prefill queue; the decode worker runs `running` streams and has measured its
    step times by batch (`curve`)."""

    def __init__(self, running: int, curve: tuple[tuple[float, float], ...]) -> None:
        super().__init__(queued=0)
        self.running = running
        self.curve = curve

    def read(self, roles: Iterable[Role]) -> list[WorkerSignal]:
        prefill, decode = super().read(roles)
        return [prefill, replace(decode, running=self.running, decode_curve=self.curve)]


# 10 ms at 1 stream, 50 ms at 8: 11 streams predict 50 + 3 x 40/7 = 67 ms.
CURVE = ((1.0, 0.010), (8.0, 0.050))


@run
async def test_itl_budget_holds_the_lowest_class_first() -> None:
    """With 80 ms of ITL budget a 67 ms step admits critical (80 ms) and standard (72)
    streams at once; sheddable (64) waits, is refused at its budget naming the decode
    step, and is admitted once the batch is smaller."""
    board = DecodeBoard(running=10, curve=CURVE)
    admission = await started(board, itl_budget_s=0.08)
    for priority in (CRIT, STD):
        granted = await asyncio.wait_for(admission.admit(priority, "a", 1.0, Cost(10, 100)), 0.05)
        assert granted is not None
        granted.settled = True  # the stream is on the decode worker: its signal counts it
    t0 = time.monotonic()
    with pytest.raises(Overloaded, match=r"decode step it would join is predicted at 67 ms"):
        await admission.admit(SHED, "a", 1.0, Cost(10, 100))
    assert time.monotonic() - t0 >= 0.2  # it waited its whole 0.2 s budget
    board.running = 5  # 6 streams: 33 ms
    assert await asyncio.wait_for(admission.admit(SHED, "a", 1.0, Cost(10, 100)), 0.2)
    await admission.close()


@run
async def test_admitted_streams_count_before_the_signal_shows_them() -> None:
    """Each admitted stream the decode worker has not reported yet joins the batch the
    next one is predicted at: 8 streams fit 50 ms, the 9th (56 ms) waits."""
    admission = await started(DecodeBoard(running=0, curve=CURVE), itl_budget_s=0.05)
    passes = []
    for _ in range(8):
        granted = await asyncio.wait_for(admission.admit(CRIT, "a", 1.0, Cost(10, 100)), 0.05)
        assert granted is not None
        passes.append(granted)
    ninth = asyncio.create_task(admission.admit(CRIT, "a", 1.0, Cost(10, 100)))
    await asyncio.sleep(0.1)
    assert not ninth.done()
    passes[0].settled = True  # one ends before the decode worker reported it
    assert await asyncio.wait_for(ninth, 0.3)
    await admission.close()


@run
async def test_an_idle_decode_worker_takes_a_stream_however_slow_it_is() -> None:
    admission = await started(DecodeBoard(running=0, curve=((1.0, 0.5),)), itl_budget_s=0.1)
    assert await asyncio.wait_for(admission.admit(SHED, "a", 1.0, Cost(10, 100)), 0.05)
    await admission.close()


def test_a_step_slower_than_the_budget_alone_holds_all_but_an_idle_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One stream alone took 150 ms against a 100 ms budget: the busy worker takes no
    more (said once in the log), and an idle one still takes a stream."""

    async def scenario() -> None:
        board = DecodeBoard(running=3, curve=((1.0, 0.15), (4.0, 0.20)))
        admission = await started(board, itl_budget_s=0.1)
        with pytest.raises(Overloaded):
            await admission.admit(SHED, "a", 1.0, Cost(10, 100))
        board.running = 0  # seen at the next signal read
        assert await asyncio.wait_for(admission.admit(SHED, "a", 1.0, Cost(10, 100)), 0.5)
        await admission.close()

    asyncio.run(scenario())
    assert caplog.text.count("raise --itl-budget-s") == 1


@run
async def test_a_stream_on_the_decode_worker_counts_until_a_signal_shows_it() -> None:
    """A pass whose stream began decoding after the signal was taken is still counted
    (the worker's `running` does not have it yet); once a later signal is read, the
    signal's count stands alone."""
    board = DecodeBoard(running=7, curve=CURVE)  # 8 streams: 50 ms
    admission = await started(board, itl_budget_s=0.05)
    granted = await asyncio.wait_for(admission.admit(CRIT, "a", 1.0, Cost(10, 100)), 0.05)
    assert granted is not None
    granted.decode_at = time.monotonic() + 1.0  # it started after any signal so far
    granted.settled = True
    waiting = asyncio.create_task(admission.admit(CRIT, "a", 1.0, Cost(10, 100)))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # 7 shown + 1 unseen: a 9th stream would take 56 ms
    board.running = 6  # one stream ended; the new one is counted in the signal now
    granted.decode_at = 0.0
    assert await asyncio.wait_for(waiting, 0.3)
    await admission.close()


@run
async def test_calibrated_streams_gaps_tighten_admission() -> None:
    """Streams' gaps ran 1.5x the predicted step: 6 streams (39 ms, 58 ms calibrated)
    no longer fit a 50 ms budget; uncalibrated they did."""
    admission = await started(DecodeBoard(running=5, curve=CURVE), itl_budget_s=0.05)
    granted = await asyncio.wait_for(admission.admit(CRIT, "a", 1.0, Cost(10, 100)), 0.05)
    assert granted is not None and granted.itl_estimate_s == pytest.approx(0.0386, abs=1e-3)
    granted.settled = True
    admission.capacity.itl_calibration.factor = 1.5
    with pytest.raises(Overloaded, match="predicted at 58 ms"):
        await admission.admit(SHED, "a", 1.0, Cost(10, 100))
    await admission.close()
