"""Priority classes and deadlines in the scheduler, model-free (`scheduler_sim.Sim`: exact
block accounting after every step): admission takes higher classes first and FIFO within
one; a preempted request goes back to the front of its own class; preemption takes the
lowest class's newest request and never a higher class's for a lower one; a preempted
request past its deadline ends with DEADLINE instead of being recomputed; a workload of
one class schedules exactly as before. Every test ends with a leak check.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.finish_reason import FinishReason
from engine.priority import Priority
from engine.request import Request, RequestStatus
from engine.stats import ClassCounts
from engine.waiting_queue import WaitingQueue
from tests.unit.engine.scheduler_sim import Sim, assert_complete, make_req, make_sim

SHED, STD, CRIT = Priority.SHEDDABLE, Priority.STANDARD, Priority.CRITICAL
FAR = 3600.0  # seconds: a deadline that never passes during a test


def admission_order(sim: Sim) -> list[str]:
    """Run to the end; the ids in the order they were first scheduled."""
    order: list[str] = []
    while sim.sched.has_work():
        for r, _ in sim.step().items:
            if r.request_id not in order:
                order.append(r.request_id)
    return order


# -- the waiting queue -------------------------------------------------------------


def test_waiting_queue_orders_by_class_then_arrival() -> None:
    q = WaitingQueue()
    spec = [("s1", SHED), ("c1", CRIT), ("t1", STD), ("s2", SHED), ("c2", CRIT)]
    s1, c1, t1, s2, c2 = (make_req(n, [1], 1, priority=p) for n, p in spec)
    for r in (s1, c1, t1, s2, c2):
        q.append(r)
    pre = make_req("pre", [1], 1, priority=STD)
    q.appendleft(pre)  # a preempted request: front of its class, behind higher classes
    assert list(q) == [c1, c2, pre, t1, s1, s2]
    assert len(q) == 6 and q[2] is pre and q.first() is c1
    assert (q.count(CRIT), q.count(STD), q.count(SHED)) == (2, 2, 2)
    q.remove(t1)
    assert t1 not in q and pre in q
    assert [q.popleft() for _ in range(len(q))] == [c1, c2, pre, s1, s2]
    assert not q
    with pytest.raises(IndexError):
        q.first()


# -- admission ---------------------------------------------------------------------


def test_a_higher_class_is_admitted_first_even_if_it_arrived_later() -> None:
    sim = make_sim(max_num_seqs=1)
    blocker = make_req("blocker", range(8), max_tokens=3)
    sim.add(blocker)
    sim.step()
    late = [make_req(n, range(100, 108), 2, priority=p)
            for n, p in [("shed", SHED), ("std", STD), ("crit", CRIT)]]  # fmt: skip
    sim.add(*late)
    assert [r.request_id for r in sim.sched.waiting] == ["crit", "std", "shed"]
    assert admission_order(sim) == ["blocker", "crit", "std", "shed"]
    for r in (blocker, *late):
        assert_complete(r)
    sim.assert_no_leaks()


def test_admission_is_fifo_within_a_class() -> None:
    sim = make_sim(max_num_seqs=1)
    spec = [("s1", SHED), ("c1", CRIT), ("t1", STD), ("s2", SHED), ("c2", CRIT), ("t2", STD)]
    reqs = [make_req(n, range(10 * i, 10 * i + 5), 2, priority=p) for i, (n, p) in enumerate(spec)]
    sim.add(*reqs)
    assert admission_order(sim) == ["c1", "c2", "t1", "t2", "s1", "s2"]
    for r in reqs:
        assert_complete(r)
    sim.assert_no_leaks()


def test_a_preempted_request_goes_to_the_front_of_its_class_not_ahead_of_a_higher_one() -> None:
    sim = make_sim(num_blocks=4, block_size=4)
    a = make_req("a", range(3), max_tokens=8)  # grows to 3 blocks
    b = make_req("b", range(100, 103), max_tokens=8)
    sim.add(a, b)
    sim.step()
    crit = make_req("crit", range(200, 212), max_tokens=2, priority=CRIT)  # 3 blocks: waits
    std = make_req("std", range(300, 312), max_tokens=2)
    sim.add(crit, std)
    while not sim.sched.num_preemptions:
        batch = sim.step()
    assert batch.preempted == [b]
    assert list(sim.sched.waiting) == [crit, b, std]
    sim.run()
    for r in (a, b, crit, std):
        assert_complete(r)
    sim.assert_no_leaks()


# -- preemption --------------------------------------------------------------------


def test_victims_are_the_lowest_class_newest_first() -> None:
    sim = make_sim(num_blocks=4, block_size=4)
    s1 = make_req("s1", range(3), max_tokens=6, priority=SHED)
    s2 = make_req("s2", range(100, 103), max_tokens=6, priority=SHED)
    sim.add(s1, s2)
    sim.step()
    crit = make_req("crit", range(200, 203), max_tokens=8, priority=CRIT)
    std = make_req("std", range(300, 303), max_tokens=8)
    sim.add(crit, std)  # admitted after the sheddables: std is the newest of all
    sim.step()
    assert sim.pool.num_free == 0
    victims: list[str] = []
    while sim.sched.has_work():
        victims += [v.request_id for v in sim.step().preempted]
    # The sheddables go first, newest first, though std was admitted after both; then
    # std before crit, whose place was never taken.
    assert victims[:3] == ["s2", "s1", "std"]
    assert crit.num_preemptions == 0
    counts = sim.sched.preemptions_by_class
    assert counts[CRIT] == 0 and counts[SHED] >= 2 and counts[STD] >= 1
    for r in (s1, s2, crit, std):
        assert_complete(r)
    sim.assert_no_leaks()


def test_a_critical_request_is_never_preempted_for_a_sheddable_one() -> None:
    sim, shed, crit = _sheddable_then_critical_on_a_full_pool()
    batch = sim.step()  # shed needs a block; crit, admitted last, would have been the victim
    assert batch.preempted == [shed] and [r for r, _ in batch.items] == [crit]
    assert shed.status is RequestStatus.WAITING and list(sim.sched.waiting) == [shed]
    sim.run()
    assert crit.num_preemptions == 0
    assert_complete(crit)
    assert_complete(shed)
    sim.assert_no_leaks()


def test_a_dry_class_does_not_stop_a_higher_one_in_the_same_step() -> None:
    """A sheddable decode that has to preempt itself leaves the rest of the step to
    higher classes: a critical prefill chunk placed after it still runs, in its blocks."""
    sim = make_sim(num_blocks=2, block_size=4, budget=4)
    shed = make_req("shed", range(3), max_tokens=4, priority=SHED)
    sim.add(shed)
    sim.step()
    crit = make_req("crit", range(100, 107), max_tokens=1, priority=CRIT)
    sim.add(crit)
    sim.step()  # shed decodes; crit's first chunk (3 tokens) takes the last block
    batch = sim.step()  # shed needs its 2nd block: none free, and crit is above it
    assert batch.preempted == [shed]
    assert [r.request_id for r, _ in batch.items] == ["crit"]
    sim.run()
    assert_complete(shed)
    assert_complete(crit)
    sim.assert_no_leaks()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from(list(Priority))),
        min_size=1,
        max_size=10,
    ),
    st.integers(13, 24),  # one request needs at most 52 tokens: 13 blocks
)
def test_no_request_is_preempted_while_a_lower_class_keeps_running(
    specs: list[tuple[int, int, Priority]], num_blocks: int
) -> None:
    sim = make_sim(num_blocks=num_blocks, block_size=4, budget=16)
    reqs = [make_req(f"r{i}", range(100 * i, 100 * i + n), m, priority=p)
            for i, (n, m, p) in enumerate(specs)]  # fmt: skip
    sim.add(*reqs)
    while sim.sched.has_work():
        assert sim.steps < 2000
        batch = sim.step()
        if batch.preempted:
            lowest_running = min((r.priority for r in sim.sched.running), default=max(Priority))
            assert max(v.priority for v in batch.preempted) <= lowest_running
    for r in reqs:
        assert_complete(r)
    sim.assert_no_leaks()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8),
    st.integers(13, 24),  # one request needs at most 52 tokens: 13 blocks
)
def test_one_class_schedules_exactly_as_any_other(
    specs: list[tuple[int, int]], num_blocks: int
) -> None:
    """The class only matters relative to other classes: a one-class workload (the only
    kind before classes) gets the same batches and preemptions whichever class it is."""

    def trace(priority: Priority) -> list[tuple[list[tuple[str, int]], list[str]]]:
        sim = make_sim(num_blocks=num_blocks, block_size=4, budget=16)
        sim.add(*[make_req(f"r{i}", range(100 * i, 100 * i + n), m, priority=priority)
                  for i, (n, m) in enumerate(specs)])  # fmt: skip
        steps = [([(r.request_id, n) for r, n in b.items], [v.request_id for v in b.preempted])
                 for b in sim.run()]  # fmt: skip
        sim.assert_no_leaks()
        return steps

    assert trace(SHED) == trace(STD) == trace(CRIT)


# -- deadlines ---------------------------------------------------------------------


def test_a_preempted_request_past_its_deadline_ends_with_deadline_and_frees_its_blocks() -> None:
    sim, shed, crit = _sheddable_then_critical_on_a_full_pool(deadline=time.monotonic() - 1)
    batch = sim.step()
    assert batch.preempted == [shed] and batch.expired == [shed]
    assert shed.finish_reason is FinishReason.DEADLINE
    assert shed.status is RequestStatus.FINISHED_DEADLINE
    assert shed.block_ids == [] and shed not in sim.sched.waiting
    assert "shed" not in sim.sched.requests
    assert sim.pool.stats().used == len(crit.block_ids)
    assert len(shed.output_token_ids) == 2  # what it produced before still went out
    sim.run()
    assert_complete(crit)
    assert sim.finished == [shed, crit]
    sim.assert_no_leaks()


def test_a_preempted_request_before_its_deadline_is_recomputed() -> None:
    sim, shed, crit = _sheddable_then_critical_on_a_full_pool(deadline=time.monotonic() + FAR)
    batch = sim.step()
    assert batch.preempted == [shed] and batch.expired == []
    sim.run()
    assert_complete(shed)
    assert_complete(crit)
    sim.assert_no_leaks()


def test_a_deadline_that_passes_while_preempted_ends_it_at_readmission() -> None:
    sim, shed, crit = _sheddable_then_critical_on_a_full_pool(deadline=time.monotonic() + FAR)
    assert sim.step().preempted == [shed]
    shed.deadline = time.monotonic() - 1  # as if it had waited past it
    expired_at = None
    while sim.sched.has_work():
        if sim.step().expired:
            expired_at = sim.steps
    assert expired_at is not None
    assert shed.finish_reason is FinishReason.DEADLINE
    assert shed.num_computed_tokens == 0, "it was recomputed"
    assert_complete(crit)
    sim.assert_no_leaks()


def test_a_fresh_request_past_its_deadline_still_runs() -> None:
    """The engine checks a deadline only where it would recompute; the caller's own
    deadline (a gRPC one) cancels everything else."""
    sim = make_sim()
    req = make_req("a", range(20), max_tokens=3, deadline=time.monotonic() - 1)
    sim.add(req)
    sim.run()
    assert_complete(req)
    sim.assert_no_leaks()


def test_a_hold_kv_request_ended_on_its_deadline_is_not_held_for_export() -> None:
    sim, shed, crit = _sheddable_then_critical_on_a_full_pool(
        deadline=time.monotonic() - 1, hold_kv=True
    )
    assert sim.step().expired == [shed]
    assert shed.request_id not in sim.sched.held and shed.block_ids == []
    sim.run()
    assert_complete(crit)
    sim.assert_no_leaks()


def test_class_counts_follow_the_priority_values() -> None:
    assert ClassCounts._fields == tuple(p.label for p in Priority)
    counts = ClassCounts.of([CRIT, SHED, CRIT])
    assert counts[CRIT] == counts.critical == 2 and counts[SHED] == 1 and counts[STD] == 0


def _sheddable_then_critical_on_a_full_pool(
    *, deadline: float | None = None, hold_kv: bool = False
) -> tuple[Sim, Request, Request]:
    """A 2-block pool: a sheddable request decoding, then a critical one admitted after it
    (so the newest), each with one block; on the next step the sheddable needs a second
    block and the critical one does not."""
    sim = make_sim(num_blocks=2, block_size=4)
    shed = make_req("shed", range(3), 4, priority=SHED, deadline=deadline, hold_kv=hold_kv)
    sim.add(shed)
    sim.step()
    crit = make_req("crit", range(100, 103), 4, priority=CRIT)
    sim.add(crit)
    sim.step()
    assert sim.pool.num_free == 0 and sim.sched.running == [shed, crit]
    return sim, shed, crit
