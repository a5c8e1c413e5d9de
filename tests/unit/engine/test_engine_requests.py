"""Engine behaviour on the real model: sampling, preemption, cancellation, stops, bad input,
and the KV hand-off between two engines. Every test ends with a leak check."""

from __future__ import annotations

import pytest

from engine.engine import LLMEngine
from engine.errors import InvalidRequestError, UnknownRequestError
from engine.finish_reason import FinishReason
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT, long_prompt


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(kv_cache_bytes=128 << 20, max_num_batched_tokens=256)


def _ids(engine: LLMEngine, texts: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in texts]


def test_seeded_sampling_is_batch_invariant(engine: LLMEngine) -> None:
    prompts = _ids(engine, SHORT[:6])
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    (alone,) = engine.generate([prompts[0]], params)
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(5)]
    together = engine.generate(prompts, [params, *others])
    assert together[0] == alone
    (again,) = engine.generate([prompts[0]], params)
    assert again == alone
    unseeded = SamplingParams(max_tokens=12, temperature=1.5)
    draws = {tuple(engine.generate([prompts[0]], unseeded)[0]) for _ in range(3)}
    assert len(draws) > 1, "unseeded requests must not share one RNG stream"
    assert_no_leaks(engine)


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks(
    make_engine: EngineFactory,
) -> None:
    roomy = make_engine(num_kv_blocks=256)
    tight = make_engine(num_kv_blocks=14, max_num_batched_tokens=128)
    prompts = _ids(roomy, SHORT[:6])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert got == expected
    assert_no_leaks(tight)
    assert_no_leaks(roomy)


def test_cancel_frees_blocks_on_next_step(engine: LLMEngine) -> None:
    prompts = _ids(engine, [long_prompt(3), SHORT[0], SHORT[1]])
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    rids = [engine.add_request(RequestSpec(p, params)) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.stats().used_blocks > 0
    engine.abort(rids[0])
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == rids[0]]
    assert aborted and aborted[0].finished and aborted[0].finish_reason is FinishReason.ABORT
    assert rids[0] not in engine.requests
    for rid in rids[1:]:
        engine.abort(rid)
    engine.step()
    assert_no_leaks(engine)


def test_cancel_while_waiting_and_unknown_id(engine: LLMEngine) -> None:
    rid = engine.add_request(RequestSpec(_ids(engine, [SHORT[2]])[0], SamplingParams(max_tokens=5)))
    engine.abort(rid)
    engine.abort("no-such-request")
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == rid] == [FinishReason.ABORT]
    assert_no_leaks(engine)


def test_stop_conditions(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("Count: 1, 2, 3, 4,")
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    text = tok.decode(free)
    stop = text.strip()[:2]
    assert stop, text
    rid = engine.add_request(
        RequestSpec(prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))
    )
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == stop
    assert len(outs) < 20
    (by_id,) = engine.generate(
        [prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(free[3],))
    )
    assert by_id == free[: free.index(free[3]) + 1]
    (capped,) = engine.generate([prompt], SamplingParams(max_tokens=7, ignore_eos=True))
    assert capped == free[:7]
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], {"max_tokens": 4}, "prompt"),
        ([1, 2, 10**6], {"max_tokens": 4}, "prompt_token_ids"),
        ([1, -1], {"max_tokens": 4}, "prompt_token_ids"),
        ([5] * 8192, {"max_tokens": 4}, "prompt"),
        ([5] * 10, {"max_tokens": 8190}, "sampling.max_tokens"),
    ],
)
def test_bad_requests_raise_and_others_keep_running(
    engine: LLMEngine, prompt: list[int], params: dict[str, int], field: str
) -> None:
    good = engine.add_request(
        RequestSpec(_ids(engine, [SHORT[3]])[0], SamplingParams(max_tokens=6))
    )
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(RequestSpec(prompt, SamplingParams(**params)))
    assert info.value.field == field
    assert field in str(info.value)
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [good]
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_values_name_the_field(params: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**params)  # type: ignore[arg-type]
    assert info.value.field == field


def test_duplicate_request_id_is_refused(engine: LLMEngine) -> None:
    p = _ids(engine, [SHORT[4]])[0]
    engine.add_request(RequestSpec(p, SamplingParams(max_tokens=3), request_id="dup"))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(RequestSpec(p, SamplingParams(max_tokens=3), request_id="dup"))
    assert info.value.field == "request_id"
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_kv_handoff_between_engines_matches_single_engine(
    make_engine: EngineFactory, engine: LLMEngine, kv_dtype: str
) -> None:
    """Prefill in one engine, copy the held blocks into another, decode there.

    The copy moves whole block rows, as NIXL and the TCP backend do: an 8-bit cache's
    scales travel inside them, and the prompt's partial last block keeps growing on the
    decode side with the scales it brought."""
    prefill = make_engine(num_kv_blocks=200, kv_cache_dtype=kv_dtype)
    decode = make_engine(num_kv_blocks=200, kv_cache_dtype=kv_dtype)
    prompt = engine.tokenizer.encode(long_prompt(4))
    assert len(prompt) % 16 != 0
    params = SamplingParams(max_tokens=16)
    single = (
        engine if kv_dtype == "auto" else make_engine(num_kv_blocks=200, kv_cache_dtype=kv_dtype)
    )
    (expected,) = single.generate([prompt], params)

    rid = prefill.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1)), hold_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    held = prefill.handoff.held_kv(rid)
    assert held.num_tokens == len(prompt) and held.first_token_id == expected[0]
    assert prefill.stats().held_blocks == len(held.block_ids) > 0

    slot = decode.handoff.reserve_import(
        RequestSpec(prompt, params, request_id="d1"), held.first_token_id
    )
    assert slot.num_cached_blocks == 0
    decode.kv_blocks[slot.blocks_to_fill] = prefill.kv_blocks[held.block_ids]
    prefill.handoff.release_held(rid)
    decode.handoff.commit_import("d1")
    out: list[int] = [held.first_token_id]
    while decode.has_unfinished():
        for o in decode.step():
            out += o.new_token_ids
    assert out == expected
    assert_no_leaks(prefill)
    assert_no_leaks(decode)

    # Second import of the same prompt: every full block is already cached locally.
    slot2 = decode.handoff.reserve_import(
        RequestSpec(prompt, params, request_id="d2"), held.first_token_id
    )
    assert slot2.num_cached_blocks == len(prompt) // decode.config.block_size
    assert decode.handoff.cancel_import("d2")
    with pytest.raises(UnknownRequestError):
        decode.handoff.commit_import("d2")
    assert_no_leaks(decode)


def test_held_kv_released_by_abort(make_engine: EngineFactory) -> None:
    eng = make_engine(num_kv_blocks=64)
    rid = eng.add_request(
        RequestSpec(eng.tokenizer.encode(long_prompt(1)), SamplingParams(max_tokens=1)),
        hold_kv=True,
    )
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().held_blocks > 0
    eng.abort(rid)
    eng.step()
    assert_no_leaks(eng)


def test_abort_during_import_frees_blocks_only_after_the_bytes_land(
    make_engine: EngineFactory,
) -> None:
    eng = make_engine(num_kv_blocks=64)
    prompt = eng.tokenizer.encode(long_prompt(1))
    slot = eng.handoff.reserve_import(
        RequestSpec(prompt, SamplingParams(max_tokens=4), request_id="imp"), 5
    )
    eng.abort("imp")
    eng.step()
    # A transfer may still be writing into these blocks: they must not be handed out yet.
    assert eng.stats().used_blocks == len(slot.block_ids)
    assert eng.handoff.commit_import("imp") is FinishReason.ABORT
    assert_no_leaks(eng)
