"""Priority classes and deadlines through the engine's API on the real model: a critical
request keeps its place (and its exact output) while a sheddable one past its deadline
is preempted and ends with a typed DEADLINE outcome; the class travels with an import;
a bad class is refused naming the field. Every test ends with a leak check."""

from __future__ import annotations

import time

import pytest

from engine.engine import LLMEngine
from engine.errors import DeadlineExceededError, InvalidRequestError
from engine.finish_reason import FinishReason
from engine.priority import Priority
from engine.request import RequestOutput
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT

MAX_TOKENS = 40
BLOCK = 16  # EngineConfig's default block_size


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=16)


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_a_sheddable_request_past_its_deadline_gives_way_and_ends_typed(
    make_engine: EngineFactory,
) -> None:
    roomy = make_engine(num_kv_blocks=64)
    crit_ids, shed_ids = (roomy.tokenizer.encode(t) for t in SHORT[:2])
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    (expected,) = roomy.generate([crit_ids], params)
    # Room for the critical request to finish and for both prompts, not both outputs.
    pool = _blocks(len(crit_ids) + MAX_TOKENS) + 1
    assert _blocks(len(crit_ids)) + _blocks(len(shed_ids)) <= pool
    assert _blocks(len(crit_ids) + MAX_TOKENS) + _blocks(len(shed_ids) + MAX_TOKENS) > pool
    tight = make_engine(num_kv_blocks=pool)
    # The sheddable one arrives first: it would be the older, kept one without classes.
    tight.add_request(
        RequestSpec(
            shed_ids,
            params,
            request_id="shed",
            priority=Priority.SHEDDABLE,
            deadline=time.monotonic() - 1,
        )
    )
    tight.add_request(RequestSpec(crit_ids, params, request_id="crit", priority=Priority.CRITICAL))
    outs = _drain(tight)
    assert [t for o in outs["crit"] for t in o.new_token_ids] == expected
    assert outs["crit"][-1].finish_reason is FinishReason.LENGTH
    last = outs["shed"][-1]
    assert last.finished and last.finish_reason is FinishReason.DEADLINE
    assert last.new_token_ids == [] and 0 < last.num_output_tokens < MAX_TOKENS
    with pytest.raises(DeadlineExceededError, match="deadline"):
        last.raise_for_deadline()
    outs["crit"][-1].raise_for_deadline()  # a finished output passes
    stats = tight.stats()
    assert stats.preemptions_by_class.sheddable == stats.num_preemptions == 1
    assert stats.preemptions_by_class.critical == 0
    assert stats.waiting_by_class == stats.running_by_class == (0, 0, 0)
    assert_no_leaks(tight)
    assert_no_leaks(roomy)


def test_the_class_and_deadline_travel_with_an_import(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(SHORT[2])
    params = SamplingParams(max_tokens=4)
    deadline = time.monotonic() + 60
    engine.handoff.reserve_import(
        RequestSpec(
            prompt, params, request_id="imp", priority=Priority.CRITICAL, deadline=deadline
        ),
        5,
    )
    req = engine.requests["imp"]
    assert req.priority is Priority.CRITICAL and req.deadline == deadline
    assert engine.handoff.cancel_import("imp")
    assert_no_leaks(engine)


def test_a_class_out_of_range_is_refused_naming_the_field(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(SHORT[0])
    with pytest.raises(InvalidRequestError, match="priority") as info:
        engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=2), priority=7))  # type: ignore[arg-type]
    assert info.value.field == "priority"
    rid = engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=2), priority=1))  # type: ignore[arg-type]
    engine.step()
    assert engine.requests[rid].priority is Priority.STANDARD  # the value, as the class
    outs = _drain(engine)
    assert outs[rid][-1].finished
    rid = engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=2)))
    engine.step()
    assert engine.requests[rid].priority is Priority.STANDARD  # the default
    _drain(engine)
    assert_no_leaks(engine)
