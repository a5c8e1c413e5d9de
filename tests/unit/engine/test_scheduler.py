"""Scheduler on a real BlockPool, driven by the engine's step loop without a model
(`scheduler_sim.Sim`: exact block accounting after every step). Every test ends with a
leak check. The hand-off states have their own file, test_scheduler_handoff.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.finish_reason import FinishReason
from engine.request import Request, RequestStatus
from engine.scheduler import SchedulerConfig
from tests.unit.engine.scheduler_sim import (
    assert_complete,
    make_req,
    make_sim,
    token_for,
)

# -- config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"block_size": 0}, {"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"block_size": -1}],
)
def test_config_rejects_non_positive(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


# -- basic flow --------------------------------------------------------------------


def test_single_request_prefill_then_decode() -> None:
    sim = make_sim()
    req = make_req("a", range(20), max_tokens=5)
    sim.add(req)
    assert req.status is RequestStatus.WAITING
    first = sim.step()
    assert first.prefills == [(req, 20)] and first.decodes == []
    assert req.status is RequestStatus.RUNNING
    assert len(req.block_ids) == 2
    assert req.output_token_ids == [token_for(req, 0)]
    for _ in range(4):
        b = sim.step()
        assert b.decodes == [req] and b.prefills == []
    assert sim.steps == 5
    assert_complete(req)
    sim.assert_no_leaks()


def test_empty_schedule_when_idle() -> None:
    sim = make_sim()
    batch = sim.sched.schedule()
    assert batch.empty and batch.num_tokens == 0 and batch.items == []
    sim.assert_no_leaks()


def test_chunked_prefill_100_tokens_budget_32_takes_4_steps() -> None:
    sim = make_sim(budget=32)
    req = make_req("a", range(100), max_tokens=3)
    sim.add(req)
    chunks = []
    for _ in range(4):
        assert req.output_token_ids == []
        b = sim.step()
        assert b.num_tokens <= 32
        chunks.append(b.items)
    assert chunks == [[(req, 32)], [(req, 32)], [(req, 32)], [(req, 4)]]
    assert req.num_computed_tokens == 100
    assert len(req.output_token_ids) == 1
    assert len(req.block_ids) == 7
    sim.run()
    assert sim.steps == 6
    assert_complete(req)
    sim.assert_no_leaks()


def test_chunked_prefill_shares_budget_and_decodes_go_first() -> None:
    sim = make_sim(budget=32)
    a = make_req("a", range(10), max_tokens=6)
    sim.add(a)
    sim.step()  # a prefilled; now decoding
    b = make_req("b", range(500, 600), max_tokens=2)
    sim.add(b)
    batch = sim.step()
    assert batch.decodes == [a]
    assert batch.prefills == [(b, 31)]  # the budget left after a's decode
    while sim.sched.has_work():
        batch = sim.step()
        assert batch.num_tokens <= 32
    assert_complete(a)
    assert_complete(b)
    sim.assert_no_leaks()


def test_continuous_batching_new_requests_join_running_decodes() -> None:
    sim = make_sim()
    a = make_req("a", range(8), max_tokens=10)
    sim.add(a)
    sim.step()
    sim.step()
    b = make_req("b", range(100, 130), max_tokens=3)
    sim.add(b)
    batch = sim.step()
    # b's prefill runs in the same step as a's decode.
    assert batch.decodes == [a]
    assert batch.prefills == [(b, 30)]
    batch = sim.step()
    assert set(map(id, batch.decodes)) == {id(a), id(b)}
    sim.step()
    assert b.finished and not a.finished
    c = make_req("c", range(200, 220), max_tokens=2)
    sim.add(c)
    batch = sim.step()
    assert batch.decodes == [a] and batch.prefills == [(c, 20)]
    sim.run()
    for r in (a, b, c):
        assert_complete(r)
    sim.assert_no_leaks()


def test_max_num_seqs_caps_running() -> None:
    sim = make_sim(max_num_seqs=2)
    reqs = [make_req(f"r{i}", range(10 * i, 10 * i + 12), max_tokens=3) for i in range(5)]
    sim.add(*reqs)
    first = sim.step()
    assert len(first.items) == 2
    assert len(sim.sched.running) == 2 and len(sim.sched.waiting) == 3
    assert all(not r.block_ids for r in reqs[2:])
    batches = sim.run()
    assert all(len(b.items) <= 2 for b in batches)
    for r in reqs:
        assert_complete(r)
    # Arrival order is kept: r0 and r1 first, r4 last.
    assert [r.request_id for r in sim.finished][:2] == ["r0", "r1"]
    assert sim.finished[-1].request_id == "r4"
    sim.assert_no_leaks()


def test_token_budget_limits_admission() -> None:
    sim = make_sim(budget=40)
    a, b = make_req("a", range(30), 2), make_req("b", range(50, 80), 2)
    sim.add(a, b)
    batch = sim.step()
    assert batch.prefills == [(a, 30), (b, 10)]
    assert b.status is RequestStatus.RUNNING
    sim.run()
    assert_complete(a)
    assert_complete(b)
    sim.assert_no_leaks()


# -- blocks ------------------------------------------------------------------------


def test_admission_waits_when_blocks_short_without_partial_allocation() -> None:
    sim = make_sim(num_blocks=4, block_size=4)
    a = make_req("a", range(12), max_tokens=2)  # 3 blocks, a 4th for its decode
    b = make_req("b", range(100, 108), max_tokens=2)  # needs 2 blocks
    sim.add(a, b)
    batch = sim.step()
    assert batch.items == [(a, 12)]
    assert b.status is RequestStatus.WAITING and list(sim.sched.waiting) == [b]
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert sim.pool.stats().used == 3
    batch = sim.step()  # a decodes into its 4th block; b still cannot fit
    assert batch.items == [(a, 1)]
    assert a.finished and b.block_ids == []
    batch = sim.step()
    assert batch.items == [(b, 8)]
    sim.run()
    assert_complete(a)
    assert_complete(b)
    sim.assert_no_leaks()


def test_failed_admission_gives_back_claimed_prefix_blocks() -> None:
    sim = make_sim(num_blocks=5, block_size=4)
    prefix = list(range(8))
    warm = make_req("warm", prefix, max_tokens=1)
    sim.add(warm)
    sim.run()
    assert sim.pool.stats().cached_free == 2
    hog = make_req("hog", range(100, 110), max_tokens=3)  # 3 blocks
    sim.add(hog)
    sim.step()
    # b hits the 2 cached blocks but needs 2 more for its tail: only 0 left after the hits.
    b = make_req("b", [*prefix, 50, 51, 52, 53, 54], max_tokens=1)
    sim.add(b)
    batch = sim.step()
    assert [r for r, _ in batch.items] == [hog]
    assert b.status is RequestStatus.WAITING
    assert b.block_ids == [] and b.num_computed_tokens == 0
    s = sim.pool.stats()
    assert s.cached_free == 2 and s.used == 3  # the hits went back to the cache
    sim.run()
    assert_complete(b)
    assert b.num_cached_tokens == 8
    sim.assert_no_leaks()


def test_preemption_by_recompute_when_pool_runs_dry() -> None:
    sim = make_sim(num_blocks=5, block_size=4)
    a = make_req("a", range(4), max_tokens=8)
    b = make_req("b", range(100, 104), max_tokens=8)
    sim.add(a, b)
    preempt_step = None
    outputs_before = None
    while sim.sched.has_work():
        outputs_before = list(b.output_token_ids)
        batch = sim.step()
        if batch.preempted:
            preempt_step = sim.steps
            # The most recently admitted request goes, back to the head of the queue.
            assert batch.preempted == [b]
            assert sim.sched.waiting[0] is b
            assert b.status is RequestStatus.WAITING
            assert b not in sim.sched.running
            assert b.block_ids == [] and b.num_computed_tokens == 0
            assert b.output_token_ids == outputs_before  # outputs kept
            assert len(outputs_before) == 5
            assert b.num_preemptions == 1 and sim.sched.num_preemptions == 1
            assert [r for r, _ in batch.items] == [a]
            break
    assert preempt_step == 6
    sim.run()
    assert sim.sched.num_preemptions == 1
    assert_complete(a)
    assert_complete(b)  # its kept outputs plus the rest, no token lost or repeated
    assert b.num_cached_tokens == 0  # recompute hits are not counted as user hits
    assert sim.sched.prefix_hit_tokens == 0
    assert sim.sched.prefix_query_tokens == 8
    sim.assert_no_leaks()


def test_preempted_request_goes_ahead_of_requests_already_waiting() -> None:
    sim = make_sim(num_blocks=5, block_size=4)
    a = make_req("a", range(4), max_tokens=8)
    b = make_req("b", range(100, 104), max_tokens=8)
    sim.add(a, b)
    sim.step()
    sim.step()  # a and b hold 2 blocks each; 1 free
    late = make_req("late", range(200, 208), max_tokens=1)  # needs 2 blocks: waits
    sim.add(late)
    while not sim.sched.num_preemptions:
        batch = sim.step()
        assert late.status is RequestStatus.WAITING and late.block_ids == []
    assert batch.preempted == [b]
    assert list(sim.sched.waiting) == [b, late]
    order: list[str] = []
    while sim.sched.has_work():
        for r, _ in sim.step().items:
            if r.request_id not in order:
                order.append(r.request_id)
    # b is re-admitted before (or in the same step ahead of) the request that waited.
    assert order.index("b") < order.index("late")
    for r in (a, b, late):
        assert_complete(r)
    sim.assert_no_leaks()


# -- endings -----------------------------------------------------------------------


def test_abort_running_and_waiting_requests_frees_blocks() -> None:
    sim = make_sim(num_blocks=4, block_size=4)
    a = make_req("a", range(12), max_tokens=4)
    b = make_req("b", range(100, 108), max_tokens=4)
    sim.add(a, b)
    sim.step()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    sim.sched.finish(b, FinishReason.ABORT)
    assert b.status is RequestStatus.FINISHED_ABORTED and not sim.sched.waiting
    sim.check_accounting()
    sim.sched.finish(a, FinishReason.ABORT)
    assert a.status is RequestStatus.FINISHED_ABORTED and not sim.sched.running
    assert a.block_ids == []
    # Finishing twice is harmless.
    sim.sched.finish(a, FinishReason.ABORT)
    assert sim.sched.schedule().empty
    sim.assert_no_leaks()


def test_abort_mid_prefill_frees_blocks() -> None:
    sim = make_sim(block_size=16, budget=16)
    req = make_req("a", range(64), max_tokens=4)
    sim.add(req)
    sim.step()
    sim.step()
    assert req.num_computed_tokens == 32 and sim.pool.stats().used == 2
    sim.sched.finish(req, FinishReason.ABORT)
    sim.assert_no_leaks()


def test_abort_preempted_request_in_waiting() -> None:
    sim = make_sim(num_blocks=5, block_size=4)
    a = make_req("a", range(4), max_tokens=8)
    b = make_req("b", range(100, 104), max_tokens=8)
    sim.add(a, b)
    while not sim.sched.num_preemptions:
        sim.step()
    sim.sched.finish(b, FinishReason.ABORT)
    assert b not in sim.sched.waiting
    sim.run()
    assert_complete(a)
    sim.assert_no_leaks()


# -- randomized workload -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([2, 4, 16]),
    num_blocks=st.integers(min_value=4, max_value=24),
    budget=st.integers(min_value=1, max_value=64),
    max_num_seqs=st.integers(min_value=1, max_value=6),
)
def test_random_workload_completes_without_leaks(
    data: st.DataObject, block_size: int, num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    sim = make_sim(num_blocks, block_size, max_num_seqs, budget)
    capacity = num_blocks * block_size
    shared = list(range(3 * block_size))
    reqs: list[Request] = []
    n_reqs = data.draw(st.integers(min_value=1, max_value=8))
    for i in range(n_reqs):
        max_tokens = data.draw(st.integers(min_value=1, max_value=min(12, capacity - 1)))
        plen = data.draw(st.integers(min_value=1, max_value=capacity - max_tokens))
        if data.draw(st.booleans()):
            prompt = (shared + list(range(500 + 100 * i, 500 + 100 * i + plen)))[:plen]
        else:
            prompt = list(range(10_000 * (i + 1), 10_000 * (i + 1) + plen))
        req = make_req(f"r{i}", prompt, max_tokens)
        reqs.append(req)
    arrivals = {i: data.draw(st.integers(min_value=0, max_value=6)) for i in range(n_reqs)}
    aborted: set[int] = set()
    while arrivals or sim.sched.has_work():
        for i, at in list(arrivals.items()):
            if at == 0:
                sim.add(reqs[i])
                del arrivals[i]
            else:
                arrivals[i] = at - 1
        if sim.sched.has_work() and data.draw(st.integers(0, 9)) == 0:
            victim = data.draw(st.sampled_from([*sim.sched.running, *sim.sched.waiting]))
            sim.sched.finish(victim, FinishReason.ABORT)
            aborted.add(id(victim))
            sim.check_accounting()
        if sim.sched.has_work():
            sim.step()
        assert sim.steps < 3000, "no progress"
    for r in reqs:
        if id(r) not in aborted:
            assert_complete(r)
    s = sim.sched
    assert 0 <= s.prefix_hit_tokens <= s.prefix_query_tokens
    sim.assert_no_leaks()


def test_a_long_prefill_neither_starves_new_prompts_nor_running_decodes() -> None:
    sim = make_sim(num_blocks=200, budget=512)
    long = make_req("long", range(2000), max_tokens=2)
    sim.add(long)
    assert sim.step().prefills == [(long, 512)]  # alone: the whole budget
    short = make_req("short", range(5000, 5100), max_tokens=2)
    sim.add(short)
    batch = sim.step()
    # The short prompt is admitted at once next to a half-budget chunk of the long one.
    assert batch.prefills == [(long, 256), (short, 100)]
    # Nobody waits: the long prompt gets the budget again, less the short one's decode,
    # which runs although it sits behind the long prefill in the running list.
    third = sim.step()
    assert third.decodes == [short] and third.prefills == [(long, 511)]
    sim.run()
    assert_complete(long)
    assert_complete(short)
    sim.assert_no_leaks()


def test_an_admitted_short_prompt_finishes_before_the_long_one_takes_the_budget() -> None:
    sim = make_sim(num_blocks=300, budget=512)
    long = make_req("long", range(3000), max_tokens=2)
    sim.add(long)
    sim.step()
    short = make_req("short", range(5000, 5400), max_tokens=2)  # more than half a budget
    sim.add(short)
    assert sim.step().prefills == [(long, 256), (short, 256)]
    # Nobody waits now. Before fewest-remaining-first, the long prompt (first in the
    # running list) took the whole budget and the short one sat out its whole prefill.
    batch = sim.step()
    assert batch.prefills == [(short, 144), (long, 368)]
    assert len(short.output_token_ids) == 1
    sim.run()
    assert_complete(long)
    assert_complete(short)
    sim.assert_no_leaks()


def test_preempting_a_request_already_placed_this_step_takes_it_out_of_the_batch() -> None:
    sim = make_sim(num_blocks=8, block_size=4, budget=8)
    long = make_req("long", range(100, 128), max_tokens=1)  # 7 blocks, 4 steps of 8
    sim.add(long)
    sim.step()
    dec = make_req("dec", range(4), max_tokens=12)  # admitted after long: the victim
    sim.add(dec)
    preempted_while_decoding = 0
    while sim.sched.has_work():
        decoding = dec.status is RequestStatus.RUNNING and dec.num_computed_tokens >= 4
        batch = sim.step()
        placed = [r for r, _ in batch.items]
        for victim in batch.preempted:
            assert victim not in placed, "a preempted request was still run"
            preempted_while_decoding += victim is dec and decoding
        assert len(placed) == len(set(map(id, placed)))
    # dec's decode is placed before long's chunk, then taken back out when long's
    # chunk needs its block.
    assert preempted_while_decoding >= 1
    assert_complete(dec)
    assert_complete(long)
    sim.assert_no_leaks()


def test_two_long_prefills_in_flight_leave_half_the_budget_to_a_waiting_prompt() -> None:
    sim = make_sim(num_blocks=600, budget=512)
    a = make_req("a", range(3000), max_tokens=2)
    b = make_req("b", range(10_000, 13_000), max_tokens=2)
    sim.add(a, b)
    sim.step()  # a takes the whole budget, b waits
    sim.step()  # a's share and b's admission
    assert {r.request_id for r in sim.sched.running} == {"a", "b"}
    chat = make_req("chat", range(20_000, 20_060), max_tokens=2)
    sim.add(chat)
    batch = sim.step()
    # Before, each long prefill took its half and the chat waited for one to finish.
    assert sum(n for r, n in batch.prefills if r is not chat) <= 256
    assert (chat, 60) in batch.prefills
    sim.run()
    for r in (a, b, chat):
        assert_complete(r)
    sim.assert_no_leaks()
