"""The scheduler's hand-off states on a real BlockPool, without a model.

Prefill side: a hold_kv request that ends goes HELD_FOR_EXPORT, blocks pinned, until
`release_held` (or an abort). Decode side: `reserve_import` parks a request in
WAITING_FOR_REMOTE_KV with its blocks, then `commit_import` queues it or `cancel_import`
frees it; an abort while the bytes may be landing frees nothing until one of those.
Every test ends with a leak check (no block, no request in any state).
"""

from __future__ import annotations

import pytest

from engine.errors import OutOfBlocksError, UnknownRequestError
from engine.finish_reason import FinishReason
from engine.request import Request, RequestStatus
from tests.unit.engine.scheduler_sim import Sim, assert_complete, make_req, make_sim, token_for


def _reserve(sim: Sim, rid: str, prompt: range, max_tokens: int) -> Request:
    req = make_req(rid, prompt, max_tokens)
    req.output_token_ids.append(token_for(req, 0))  # the first token, as the engine does
    sim.sched.reserve_import(req)
    sim.check_accounting()
    return req


# -- prefill side: HELD_FOR_EXPORT -----------------------------------------------------


def test_hold_kv_finish_is_held_for_export_until_released() -> None:
    sim = make_sim(block_size=16)
    req = make_req("p", range(40), max_tokens=1, hold_kv=True)
    sim.add(req)
    sim.step()
    assert req.status is RequestStatus.HELD_FOR_EXPORT
    assert req.finished and req.finish_reason is FinishReason.LENGTH
    assert sim.sched.held == {"p": req} and sim.sched.requests == {"p": req}
    assert req not in sim.sched.running and not sim.sched.has_work()
    assert len(req.block_ids) == 3 and sim.pool.stats().used == 3
    assert all(sim.pool.ref_count(b) == 1 for b in req.block_ids)
    assert sim.sched.handoff_blocks() == (3, 0)
    assert sim.sched.release_held("p") is True
    assert req.status is RequestStatus.FINISHED_LENGTH and req.block_ids == []
    assert sim.pool.stats().cached == 2, "released full blocks stay in the prefix cache"
    assert sim.sched.release_held("p") is False
    sim.assert_no_leaks()


def test_held_request_keeps_its_stop_reason() -> None:
    sim = make_sim(block_size=16)
    req = make_req("p", range(20), max_tokens=4, hold_kv=True)
    sim.add(req)
    sim.step()
    sim.sched.finish(req, FinishReason.STOP)
    assert req.status is RequestStatus.HELD_FOR_EXPORT
    sim.sched.finish(req, FinishReason.ABORT)  # a no-op: its output is already over
    assert req.status is RequestStatus.HELD_FOR_EXPORT and req.block_ids
    assert sim.sched.release_held("p")
    assert req.status is RequestStatus.FINISHED_STOPPED
    sim.assert_no_leaks()


def test_hold_kv_abort_frees_blocks() -> None:
    sim = make_sim(block_size=16, budget=16)
    req = make_req("p", range(40), max_tokens=1, hold_kv=True)
    sim.add(req)
    sim.step()  # mid-prefill
    assert sim.pool.stats().used == 1
    assert sim.sched.abort("p") is req  # its output was open: it gets a last output
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert req.finish_reason is FinishReason.ABORT and req.block_ids == []
    assert not sim.sched.held
    sim.assert_no_leaks()


def test_abort_of_a_held_request_releases_it() -> None:
    sim = make_sim(block_size=16)
    req = make_req("p", range(40), max_tokens=1, hold_kv=True)
    sim.add(req)
    sim.step()
    assert sim.sched.abort("p") is None  # its output ended already: nothing to send
    assert req.status is RequestStatus.FINISHED_LENGTH and req.block_ids == []
    assert sim.sched.abort("p") is None and sim.sched.abort("never-added") is None
    sim.assert_no_leaks()


# -- decode side: WAITING_FOR_REMOTE_KV ------------------------------------------------


def test_reserve_then_commit_decodes_without_recompute() -> None:
    sim = make_sim(num_blocks=8, block_size=4)
    imported = _reserve(sim, "imp", range(8), max_tokens=3)
    assert imported.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert sim.sched.importing == {"imp": imported} and "imp" in sim.sched.requests
    assert not sim.sched.has_work() and sim.sched.handoff_blocks() == (0, 2)
    assert sim.sched.commit_import("imp") is imported
    assert imported.status is RequestStatus.WAITING and not sim.sched.importing
    assert imported.num_computed_tokens == 8 and sim.pool.stats().cached == 2
    batch = sim.step()
    assert batch.decodes == [imported]
    sim.run()
    assert_complete(imported)
    sim.assert_no_leaks()


def test_reserve_reuses_cached_prefix_blocks() -> None:
    sim = make_sim(num_blocks=8, block_size=4)
    first = make_req("a", range(9), max_tokens=1)
    sim.add(first)
    sim.run()  # publishes blocks [0..4) and [4..8), then frees them to the cache
    imported = _reserve(sim, "imp", range(10), max_tokens=2)
    assert len(imported.block_ids) == 3
    assert imported.num_cached_tokens == 8 and sim.sched.prefix_hit_tokens == 8
    assert sim.sched.cancel_import("imp")
    sim.assert_no_leaks()


def test_reserve_short_of_blocks_takes_nothing() -> None:
    sim = make_sim(num_blocks=4, block_size=4)
    cached = make_req("a", range(8), max_tokens=1)
    sim.add(cached)
    sim.run()  # two free blocks cached; a 5-block prompt reuses them and needs 3 more
    req = make_req("imp", range(20), max_tokens=1)
    req.output_token_ids.append(7)
    with pytest.raises(OutOfBlocksError):
        sim.sched.reserve_import(req)
    assert req.block_ids == [] and "imp" not in sim.sched.requests
    assert sim.pool.stats().cached_free == 2
    sim.assert_no_leaks()


def test_reserve_then_cancel_frees_the_blocks() -> None:
    sim = make_sim(num_blocks=8, block_size=4)
    imported = _reserve(sim, "imp", range(8), max_tokens=3)
    assert sim.sched.cancel_import("imp") is True
    assert imported.status is RequestStatus.FINISHED_ABORTED and imported.block_ids == []
    assert sim.sched.cancel_import("imp") is False
    with pytest.raises(UnknownRequestError):
        sim.sched.commit_import("imp")
    sim.assert_no_leaks()


@pytest.mark.parametrize("landing_ends_with", ["commit", "cancel"])
def test_abort_while_landing_frees_only_when_the_import_ends(landing_ends_with: str) -> None:
    sim = make_sim(num_blocks=8, block_size=4)
    imported = _reserve(sim, "imp", range(8), max_tokens=3)
    assert sim.sched.abort("imp") is None
    # A transfer may still be writing into these blocks: they must not be handed out.
    assert imported.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert sim.pool.stats().used == 2
    sim.check_accounting()
    if landing_ends_with == "commit":
        assert sim.sched.commit_import("imp") is None
    else:
        assert sim.sched.cancel_import("imp") is True
    assert imported.status is RequestStatus.FINISHED_ABORTED and imported.block_ids == []
    sim.assert_no_leaks()


def test_abort_of_a_committed_import_frees_its_blocks() -> None:
    sim = make_sim(num_blocks=8, block_size=4)
    imported = _reserve(sim, "imp", range(8), max_tokens=4)
    sim.sched.commit_import("imp")
    assert sim.sched.abort("imp") is imported
    assert imported.status is RequestStatus.FINISHED_ABORTED and imported.block_ids == []
    sim.assert_no_leaks()


def test_committed_import_keeps_its_blocks_while_waiting_for_a_decode_block() -> None:
    """A committed import waits holding its prompt's blocks; it must keep them if
    admission has to wait.

    Here the pool is full when the imported request first tries to join: its prompt
    (8 tokens, bs 4) fills its 2 blocks exactly, so its first decode needs a third.
    """
    sim = make_sim(num_blocks=4, block_size=4)
    a = make_req("a", range(100, 107), max_tokens=2)  # 2 blocks, no growth
    sim.add(a)
    sim.step()
    imported = _reserve(sim, "imp", range(8), max_tokens=3)
    imported_blocks = list(imported.block_ids)
    sim.sched.commit_import("imp")
    assert sim.pool.stats().free == 0
    batch = sim.sched.schedule()  # no block is free for imp's first decode: it waits
    assert [r for r, _ in batch.items] == [a]
    assert imported.status is RequestStatus.WAITING
    assert imported.block_ids == imported_blocks, "waiting request lost its block table"
    assert imported.num_computed_tokens == 8, "imported KV dropped: prompt will be recomputed"
    sim.sched.advance(a, 1)
    a.output_token_ids.append(token_for(a, 1))
    sim.sched.finish(a, FinishReason.LENGTH)
    sim.check_accounting()
    sim.run()
    assert_complete(a)
    assert_complete(imported)
    sim.assert_no_leaks()
