"""The role planner on recorded signals: a shifted mix moves a home role only after a
whole window of it; a hop, a missing signal, a lone decode worker or a prefill pool
with room keeps the role; the decode workers agree on which of them moves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.stats import ClassCounts
from services.common.role import Role
from services.router.worker_signal import MIN_DECODE_STREAMS, WorkerSignal
from services.worker.role_planner import BUSY_QUEUE_S, Reading, RolePlanner, lean
from tests.unit.services.test_capacity import signal

RATE = 1000.0  # prompt tokens per second of prefill
WINDOW = 10.0
LONG = 512


def _s(
    role: Role, wid: str, *, running: int = 0, waiting: int = 0, queued: int = 0
) -> WorkerSignal:
    s = signal(role, waiting=ClassCounts(standard=queued), rate=RATE, wid=wid)
    return replace(s, running=running, waiting=waiting)


def _chat(at: float, calls: int = 0) -> Reading:
    """Chat-shaped load: the decode worker carries streams, the prefill worker idles."""
    p = _s(Role.PREFILL, "p0", running=1)
    d = _s(Role.DECODE, "d0", running=MIN_DECODE_STREAMS + 1, queued=100, waiting=1)
    return Reading(at, [p, d], calls)


def _long(at: float, d1_running: int = 3) -> Reading:
    """Long prompts queued on two decode workers, no prefill pool."""
    d0 = _s(Role.DECODE, "d0", running=4, waiting=1, queued=3000)
    d1 = _s(Role.DECODE, "d1", running=d1_running, waiting=1, queued=2500)
    return Reading(at, [d0, d1], 0)


def _feed(planner: RolePlanner, role: Role, readings: list[Reading]) -> Role | None:
    for r in readings:
        planner.observe(role, r)
    return planner.want(role, readings[-1].at)


def test_an_idle_prefill_worker_becomes_decode_after_a_whole_window() -> None:
    planner = RolePlanner("p0", WINDOW, LONG)
    assert _feed(planner, Role.PREFILL, [_chat(t) for t in range(10)]) is None  # 9 s < window
    assert _feed(planner, Role.PREFILL, [_chat(10.0)]) is Role.DECODE
    planner.reset()
    assert planner.want(Role.PREFILL, 10.0) is None  # a move needs a window of its own


def test_one_prefill_call_in_the_window_keeps_the_prefill_role() -> None:
    planner = RolePlanner("p0", WINDOW, LONG)
    calls = [0] * 5 + [1] * 7  # a prompt took the hop to it between t=4 and t=5
    assert _feed(planner, Role.PREFILL, [_chat(t, c) for t, c in enumerate(calls)]) is None
    # The reading that saw the hop (t=5) covers the window's start until t=16.
    assert _feed(planner, Role.PREFILL, [_chat(t, 1) for t in range(12, 16)]) is None
    assert _feed(planner, Role.PREFILL, [_chat(16.0, 1)]) is Role.DECODE


def test_a_light_decode_pool_or_a_missing_signal_keeps_the_role() -> None:
    light = _s(Role.DECODE, "d0", running=MIN_DECODE_STREAMS - 1)
    idle_p = _s(Role.PREFILL, "p0")
    assert lean("p0", Role.PREFILL, Reading(0, [idle_p, light], 0), False, LONG) is None
    chat = _chat(0)
    without_me = Reading(0, [s for s in chat.signals if s.worker_id != "p0"], 0)
    assert lean("p0", Role.PREFILL, without_me, False, LONG) is None
    without_decode = Reading(0, [s for s in chat.signals if s.worker_id == "p0"], 0)
    assert lean("p0", Role.PREFILL, without_decode, False, LONG) is None
    busy_p = replace(idle_p, waiting_tokens=ClassCounts(standard=int(RATE)))  # a 1 s queue
    assert lean("p0", Role.PREFILL, Reading(0, [busy_p, chat.signals[1]], 0), False, LONG) is None
    assert lean("p0", Role.PREFILL, chat, False, LONG) is Role.DECODE
    assert lean("p0", Role.MIXED, chat, False, LONG) is None  # mixed never moves


def test_long_prompts_on_two_decode_workers_move_the_less_loaded_one() -> None:
    readings = [_long(float(t)) for t in range(11)]
    d1, d0 = RolePlanner("d1", WINDOW, LONG), RolePlanner("d0", WINDOW, LONG)
    assert _feed(d1, Role.DECODE, readings) is Role.PREFILL  # 3 streams against d0's 4
    assert _feed(d0, Role.DECODE, readings) is None


def test_a_prefill_move_needs_half_the_window_and_the_latest_reading() -> None:
    planner = RolePlanner("d1", WINDOW, LONG)
    # d1 is the lighter one (leans to prefill) in 6 of 11 readings, then not at the last.
    runs = [3, 5, 3, 5, 3, 5, 3, 3, 5, 3, 5]
    assert _feed(planner, Role.DECODE, [_long(t, r) for t, r in enumerate(runs)]) is None
    assert _feed(planner, Role.DECODE, [_long(11.0, 3)]) is Role.PREFILL
    sparse = RolePlanner("d1", WINDOW, LONG)
    runs = [3, 5, 5, 5, 5, 5, 5, 5, 5, 5, 3]  # 2 of 11
    assert _feed(sparse, Role.DECODE, [_long(t, r) for t, r in enumerate(runs)]) is None


def test_short_prompts_a_lone_decode_worker_or_a_prefill_pool_with_room_keep_decode() -> None:
    d0 = _s(Role.DECODE, "d0", running=4, waiting=4, queued=4 * 256)  # chat prompts queued
    d1 = _s(Role.DECODE, "d1", running=3, waiting=4, queued=4 * 256)
    assert lean("d1", Role.DECODE, Reading(0, [d0, d1], 0), False, LONG) is None
    long_ = _long(0)
    lone = Reading(0, [long_.signals[1]], 0)
    assert lean("d1", Role.DECODE, lone, False, LONG) is None
    room = _s(Role.PREFILL, "p0", queued=int(RATE * BUSY_QUEUE_S / 2))
    full = _s(Role.PREFILL, "p0", queued=int(RATE * BUSY_QUEUE_S * 2))
    assert lean("d1", Role.DECODE, Reading(0, [*long_.signals, room], 0), False, LONG) is None
    assert lean("d1", Role.DECODE, Reading(0, [*long_.signals, full], 0), False, LONG) is (
        Role.PREFILL
    )


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RolePlanner("p0", 0.0, LONG)
