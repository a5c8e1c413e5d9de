"""The engine's hand-off interface on the real model: the scheduler states it drives and
the finish reason every path reports. Every test ends with a leak check."""

from __future__ import annotations

import pytest

from engine.engine import LLMEngine
from engine.errors import InvalidRequestError, OutOfBlocksError
from engine.finish_reason import FinishReason
from engine.request import RequestOutput, RequestStatus
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT, long_prompt


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=64)


def _run(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def _eos(engine: LLMEngine) -> int:
    return min(engine.stop_checker.eos_token_ids)


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_reports_length_on_the_plain_path(engine: LLMEngine, max_tokens: int) -> None:
    prompt = engine.tokenizer.encode(SHORT[0])
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rid = engine.add_request(RequestSpec(prompt, params))
    outs = _run(engine, rid)
    assert [o.finished for o in outs] == [False] * (max_tokens - 1) + [True]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_output_tokens == max_tokens
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("max_tokens", "ignore_eos", "first_is_eos", "reason"),
    [
        (1, False, False, FinishReason.LENGTH),  # the decode worker used to say STOP
        (1, True, True, FinishReason.LENGTH),
        (4, False, True, FinishReason.STOP),
        (1, False, True, FinishReason.STOP),  # EOS is checked before the length
    ],
)
def test_an_import_ended_by_its_first_token_reports_why(
    engine: LLMEngine, max_tokens: int, ignore_eos: bool, first_is_eos: bool, reason: FinishReason
) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    first = _eos(engine) if first_is_eos else engine.tokenizer.encode("hello")[-1]
    assert first_is_eos or first not in engine.stop_checker.eos_token_ids
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    engine.handoff.reserve_import(RequestSpec(prompt, params, request_id="imp"), first)
    assert engine.handoff.commit_import("imp") is reason
    assert "imp" not in engine.requests
    assert not engine.has_unfinished()
    assert_no_leaks(engine)
    engine.pool.reset_prefix_cache()


def test_an_import_that_decodes_reports_length_at_max_tokens(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    slot = engine.handoff.reserve_import(RequestSpec(prompt, params, request_id="imp"), 5)
    assert engine.requests["imp"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert engine.stats().importing_requests == 1
    assert engine.stats().importing_blocks == len(slot.block_ids)
    # The KV is garbage (never filled), which is fine: only the ending is under test.
    assert engine.handoff.commit_import("imp") is None
    assert engine.requests["imp"].status is RequestStatus.WAITING
    outs = _run(engine, "imp")
    assert len(outs) == 2 and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_output_tokens == 3
    assert_no_leaks(engine)
    engine.pool.reset_prefix_cache()


def test_held_for_export_until_released(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    rid = engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1)), hold_kv=True)
    outs = _run(engine, rid)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    req = engine.requests[rid]
    assert req.status is RequestStatus.HELD_FOR_EXPORT
    held = engine.handoff.held_kv(rid)
    assert held.block_ids == req.block_ids and held.first_token_id == outs[-1].new_token_ids[0]
    s = engine.stats()
    assert s.held_requests == 1 and s.held_blocks == len(held.block_ids) == s.used_blocks
    with pytest.raises(InvalidRequestError):  # a held id is still live
        engine.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1), request_id=rid))
    assert engine.handoff.release_held(rid) is True
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert engine.handoff.release_held(rid) is False
    assert_no_leaks(engine)


def test_abort_while_landing_then_cancel_frees_the_blocks(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    slot = engine.handoff.reserve_import(
        RequestSpec(prompt, SamplingParams(max_tokens=4), request_id="imp"), 5
    )
    engine.abort("imp")
    assert engine.step() == []  # no stream is open for an import: nothing to report
    assert engine.stats().used_blocks == len(slot.block_ids)
    assert engine.handoff.cancel_import("imp") is True
    assert_no_leaks(engine)


def test_reserve_refusals_take_nothing(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.handoff.reserve_import(RequestSpec(prompt, params, request_id="imp"), -1)
    assert info.value.field == "first_token_id"
    engine.handoff.reserve_import(RequestSpec(prompt, params, request_id="imp"), 5)
    with pytest.raises(InvalidRequestError) as info:
        engine.handoff.reserve_import(RequestSpec(prompt, params, request_id="imp"), 5)
    assert info.value.field == "request_id"
    assert engine.handoff.cancel_import("imp")
    engine.add_request(
        RequestSpec([5] * 600, SamplingParams(max_tokens=1), request_id="hog"), hold_kv=True
    )
    _run(engine, "hog")  # pins 38 of the 64 blocks
    with pytest.raises(OutOfBlocksError):
        engine.handoff.reserve_import(
            RequestSpec([6] * 500, params, request_id="imp2"), 5
        )  # needs 32
    assert "imp2" not in engine.requests and engine.stats().importing_blocks == 0
    assert engine.handoff.release_held("hog")
    assert_no_leaks(engine)
    engine.pool.reset_prefix_cache()
