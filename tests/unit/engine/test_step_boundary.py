"""Calls from other threads while a step is running: the hand-off methods and stats never
queue behind the engine lock for longer than the step in flight (the prefill side not at
all).

A test stands in for the stepping thread by holding `engine.lock` itself, so "a step is
running" lasts exactly as long as the test says; each call under test runs on a helper
thread joined with a timeout, so code that waited for the lock fails instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from engine.engine import LLMEngine
from engine.kv_handoff import ImportSlot
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import long_prompt


class Call:
    """Runs `fn` on its own thread and keeps what it returned or raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc

    def finished_within(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()


def _wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


@pytest.fixture()
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=64)


def _held_request(eng: LLMEngine) -> str:
    rid = eng.add_request(
        RequestSpec(eng.tokenizer.encode(long_prompt(1)), SamplingParams(max_tokens=1)),
        hold_kv=True,
    )
    while eng.has_unfinished():
        eng.step()
    return rid


def test_export_release_and_stats_do_not_wait_for_a_running_step(engine: LLMEngine) -> None:
    rid = _held_request(engine)
    pinned = engine.stats().held_blocks
    assert pinned > 0
    with engine.lock:  # a step is running
        export = Call(lambda: engine.handoff.held_kv(rid))
        assert export.finished_within(2.0), "held_kv waited for the step"
        assert export.error is None and export.result.block_ids  # type: ignore[attr-defined]
        stats = Call(engine.stats)
        assert stats.finished_within(2.0), "stats waited for the step"
        assert stats.result.held_blocks == pinned  # type: ignore[attr-defined]
        release = Call(lambda: engine.handoff.release_held(rid))
        assert release.finished_within(2.0), "release_held waited for the step"
        assert release.result is True
        # The unpin is queued for the next step, and a second release finds nothing.
        assert engine.has_unfinished()
        assert engine.handoff.release_held(rid) is False
    engine.step()
    assert_no_leaks(engine)


def test_import_calls_run_first_thing_in_the_next_step(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    params = SamplingParams(max_tokens=4)
    with engine.lock:  # a step is running
        reserve = Call(
            lambda: engine.handoff.reserve_import(RequestSpec(prompt, params, request_id="imp"), 5)
        )
        _wait_until(engine.has_unfinished)  # the call is queued, not contending
        assert not reserve.finished_within(0.2)
        engine.step()  # the stepping thread's next step (the lock is reentrant)
        assert reserve.finished_within(2.0)
    assert reserve.error is None
    slot = reserve.result
    assert isinstance(slot, ImportSlot) and slot.block_ids
    assert engine.stats().importing_blocks == len(slot.block_ids)
    assert engine.handoff.cancel_import("imp") is True
    assert_no_leaks(engine)


def test_a_queued_call_runs_on_the_caller_when_nothing_steps(engine: LLMEngine) -> None:
    """No stepping thread (none started, or stopped): the caller runs its own call once
    the lock is free, and its error reaches it."""
    with engine.lock:
        cancel = Call(lambda: engine.handoff.cancel_import("never-reserved"))
        _wait_until(engine.has_unfinished)
        commit = Call(lambda: engine.handoff.commit_import("never-reserved"))
    assert cancel.finished_within(2.0) and commit.finished_within(2.0)
    assert cancel.result is False
    assert commit.error is not None and "never-reserved" in str(commit.error)
    assert_no_leaks(engine)
