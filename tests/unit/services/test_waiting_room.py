"""The waiting room alone: class order, displacement when full, budget expiry, and
deficit round robin in KV-block-seconds with weights, holds and aging."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.priority import Priority
from services.gateway.flow.waiting_room import Ticket, WaitingRoom

CRIT, STD, SHED = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def ticket(p: Priority = STD, tenant: str = "a", *, charge: float = 1.0, weight: float = 1.0,
           arrived: float = 0.0, budget: float = 10.0) -> Ticket:  # fmt: skip
    return Ticket(p, tenant, weight, charge, arrived, budget)


def drain(room: WaitingRoom, now: float = 0.0, **kw: object) -> list[Ticket]:
    out = []
    while (t := room.pick(now, lambda t: True, **kw)) is not None:  # type: ignore[arg-type]
        out.append(t)
    return out


def test_higher_class_first_fifo_within_tenant() -> None:
    room = WaitingRoom(10)
    s1, c1, st1, c2 = ticket(SHED), ticket(CRIT), ticket(STD), ticket(CRIT)
    for t in (s1, c1, st1, c2):
        assert room.offer(t) is None
    assert drain(room) == [c1, c2, st1, s1]
    assert len(room) == 0


def test_nothing_jumps_a_head_that_does_not_fit() -> None:
    room = WaitingRoom(10)
    big, small = ticket(CRIT, charge=5), ticket(SHED)
    room.offer(big)
    room.offer(small)
    assert room.pick(0.0, lambda t: t is not big) is None  # the small one waits too
    assert room.pick(0.0, lambda t: True) is big


def test_full_room_refuses_the_lowest_class_first() -> None:
    room = WaitingRoom(2)
    s1, s2 = ticket(SHED), ticket(SHED)
    room.offer(s1)
    room.offer(s2)
    newcomer = ticket(SHED)
    assert room.offer(newcomer) is newcomer  # same class: the newcomer is refused
    crit = ticket(CRIT)
    assert room.offer(crit) is s2  # a higher class displaces the newest lower one
    std = ticket(STD)
    assert room.offer(std) is s1
    assert room.offer(ticket(STD)) is not None and room.count(CRIT) == 1
    # Critical is never refused while a lower class holds a place.
    room2 = WaitingRoom(1)
    room2.offer(ticket(STD))
    assert room2.offer(c := ticket(CRIT)) is not c


def test_zero_room_refuses_everyone() -> None:
    room = WaitingRoom(0)
    t = ticket(CRIT)
    assert room.offer(t) is t


def test_expired_leave_at_their_budget() -> None:
    room = WaitingRoom(10)
    short, long = ticket(SHED, budget=2.0), ticket(CRIT, budget=10.0)
    room.offer(short)
    room.offer(long)
    assert room.expired(1.9) == []
    assert room.expired(2.0) == [short]
    assert room.expired(9.99) == [] and room.expired(10.0) == [long]
    assert len(room) == 0


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)])
def test_drr_shares_block_seconds_by_weight(weights: tuple[float, float]) -> None:
    """Tenant a sends big requests, b small ones; served block-seconds follow weights."""
    room = WaitingRoom(10_000)
    for _ in range(600):
        room.offer(ticket(tenant="a", charge=8.0, weight=weights[0]))
    for _ in range(4000):
        room.offer(ticket(tenant="b", charge=1.0, weight=weights[1]))
    served: Counter[str] = Counter()
    for _ in range(1500):  # while both stay backlogged
        t = room.pick(0.0, lambda t: True)
        assert t is not None
        served[t.tenant] += t.charge
    ratio = served["b"] / served["a"]
    assert ratio == pytest.approx(weights[1] / weights[0], rel=0.05)


def test_an_idle_tenant_keeps_no_credit() -> None:
    room = WaitingRoom(100)
    room.offer(ticket(tenant="a", charge=1.0))
    room.offer(ticket(tenant="b", charge=10.0))
    first = room.pick(0.0, lambda t: True)
    assert first is not None and first.tenant == "a"  # cheaper head paid first
    # a left the ring; its deficit is gone: a new ticket of a starts from zero.
    room.offer(ticket(tenant="a", charge=1.0))
    order = [t.tenant for t in drain(room)]
    assert sorted(order) == ["a", "b"]


def test_held_tenants_wait_while_held() -> None:
    room = WaitingRoom(10)
    a, b = ticket(tenant="a", arrived=0.0, budget=10), ticket(tenant="b", arrived=0.0, budget=10)
    room.offer(a)
    room.offer(b)
    held = {"a"}
    assert room.pick(1.0, lambda t: True, lambda p, t: t in held) is b
    assert room.pick(9.0, lambda t: True, lambda p, t: t in held) is None  # only a: held
    held.clear()  # the others caught up or stopped waiting
    assert room.pick(9.0, lambda t: True, lambda p, t: t in held) is a


def test_only_tenants_with_a_viable_ticket_count_as_waiting() -> None:
    room = WaitingRoom(10)
    stale, fresh = ticket(tenant="a", arrived=0.0), ticket(tenant="b", arrived=5.0)
    room.offer(stale)
    room.offer(fresh)
    assert room.tenants(STD) == ["a", "b"]
    assert room.tenants(STD, lambda t: t is not stale) == ["b"]


def test_a_held_class_lets_lower_classes_through() -> None:
    room = WaitingRoom(10)
    crit, std = ticket(CRIT, tenant="a"), ticket(STD, tenant="b")
    room.offer(crit)
    room.offer(std)
    assert room.pick(0.0, lambda t: True, lambda p, t: t == "a") is std


def test_a_doomed_ticket_does_not_block_the_ones_behind_it() -> None:
    room = WaitingRoom(10)
    old, fresh = ticket(tenant="a", arrived=0.0), ticket(tenant="a", arrived=4.0)
    other = ticket(tenant="b", arrived=4.5)
    for t in (old, fresh, other):
        room.offer(t)
    doomed = lambda t: t is old  # noqa: E731 - waited too long to make its budget
    started = [room.pick(5.0, lambda t: True, doomed=doomed) for _ in range(2)]
    assert set(started) == {fresh, other}
    assert room.pick(5.0, lambda t: True, doomed=doomed) is None
    assert room.expired(10.0) == [old]
