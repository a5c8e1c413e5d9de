"""Resuming a request after output another engine made (a migrated stream): greedy,
seeded, penalised and grammar-guided runs go on exactly as one uninterrupted run, also
when the prompt's KV is imported from a prefill engine (only the tokens so far are
computed), and a resume the engine cannot honour is refused by name. Every test ends
with a leak check."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.finish_reason import FinishReason
from engine.grammar import GuidedKind, GuidedSpec
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT, long_prompt


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(kv_cache_bytes=64 << 20, max_num_batched_tokens=256)


def _run(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, resume: Sequence[int] = ()
) -> tuple[list[int], FinishReason | None]:
    rid = engine.add_request(RequestSpec(prompt, params, resume_token_ids=resume))
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                reason = out.finish_reason if out.finished else reason
    return tokens, reason


PENALISED = SamplingParams(
    max_tokens=20, temperature=0.8, seed=3, frequency_penalty=0.7, presence_penalty=0.4,
    repetition_penalty=1.2, min_tokens=18,
)  # fmt: skip
CASES = {
    "greedy": SamplingParams(max_tokens=20, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    "penalised": PENALISED,
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_resumed_request_continues_its_own_sequence(engine: LLMEngine, name: str) -> None:
    params = CASES[name]
    prompt = engine.tokenizer.encode(SHORT[1])
    whole, reason = _run(engine, prompt, params)
    assert len(whole) == 20 and reason is FinishReason.LENGTH
    for cut in (1, 9, 19):
        rest, rest_reason = _run(engine, prompt, params, whole[:cut])
        assert whole[:cut] + rest == whole, f"cut at {cut}"
        assert rest_reason is FinishReason.LENGTH
    assert_no_leaks(engine)


def test_a_resumed_request_in_a_batch_matches_one_alone(engine: LLMEngine) -> None:
    params = CASES["seeded"]
    prompts = [engine.tokenizer.encode(t) for t in SHORT[:4]]
    wholes = engine.generate(prompts, params)
    rids = [
        engine.add_request(RequestSpec(p, params, resume_token_ids=w[:5]))
        for p, w in zip(prompts, wholes, strict=True)
    ]
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert [w[:5] + got[r] for w, r in zip(wholes, rids, strict=True)] == wholes
    assert_no_leaks(engine)


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_an_imported_prompt_resumes_computing_only_the_tokens_so_far(
    engine: LLMEngine, make_engine: EngineFactory, name: str
) -> None:
    """What a decode worker does with a migrated stream whose prompt the prefill worker
    still caches: import the prompt's blocks, compute the output so far, go on. The
    exporter's own first draw is ignored: the stream's tokens say what came out."""
    params = CASES[name]
    prompt = engine.tokenizer.encode(long_prompt(2))
    whole, _ = _run(engine, prompt, params)
    prefill = make_engine(kv_cache_bytes=32 << 20)
    rid = prefill.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1)), hold_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    held = prefill.handoff.held_kv(rid)
    other_draw = (whole[0] + 1) % engine.spec.vocab_size
    engine.pool.reset_prefix_cache()  # nothing of the prompt cached here: all imported
    slot = engine.handoff.reserve_import(
        RequestSpec(prompt, params, request_id="moved", resume_token_ids=whole[:7]), other_draw
    )
    assert slot.num_cached_blocks == 0
    engine.kv_blocks[slot.blocks_to_fill] = prefill.kv_blocks[held.block_ids]
    prefill.handoff.release_held(rid)
    assert engine.handoff.commit_import("moved") is None
    computed_before = engine.stats().prefill_tokens_total
    rest: list[int] = []
    while engine.has_unfinished():
        rest += [t for o in engine.step() for t in o.new_token_ids]
    assert whole[:7] + rest == whole
    # The first step computed the 7 streamed tokens' KV, not the prompt's again.
    assert engine.stats().prefill_tokens_total - computed_before == 7
    assert_no_leaks(engine)
    assert_no_leaks(prefill)


def test_a_guided_request_resumes_inside_its_grammar(engine: LLMEngine) -> None:
    spec = GuidedSpec(GuidedKind.REGEX, r"[a-c]{4}-[0-9]{3}")
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=11, guided=spec)
    prompt = engine.tokenizer.encode(SHORT[0])
    whole, reason = _run(engine, prompt, params)
    assert reason is FinishReason.STOP
    rest, _ = _run(engine, prompt, params, whole[:3])
    assert whole[:3] + rest == whole
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    ("params", "resume", "limit"),
    [
        (SamplingParams(max_tokens=4), [1, 2, 3, 4], "fewer than max_tokens"),
        (SamplingParams(max_tokens=8, n=2, temperature=1.0), [1], "n = 1"),
        (SamplingParams(max_tokens=8, prompt_logprobs=1), [1], "prompt_logprobs"),
        (SamplingParams(max_tokens=8), [10**9], "each id must be in"),
    ],
)
def test_a_resume_the_engine_cannot_honour_is_refused_by_name(
    engine: LLMEngine, params: SamplingParams, resume: list[int], limit: str
) -> None:
    with pytest.raises(InvalidRequestError, match=limit) as err:
        engine.add_request(RequestSpec([1, 2, 3], params, resume_token_ids=resume))
    assert err.value.field == "resume_token_ids"
    assert not engine.has_unfinished()
    assert_no_leaks(engine)
