"""Forks (n > 1) on one engine: one prefill for all of them, the prompt's full blocks
shared, each fork its own sampling stream, greedy forks identical, and an abort of the
group freeing every fork's blocks."""

from __future__ import annotations

import pytest

from engine.engine import LLMEngine
from engine.request import RequestOutput
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import long_prompt


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(kv_cache_bytes=64 << 20)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> dict[int, list[int]]:
    rid = engine.add_request(RequestSpec(prompt, params))
    texts: dict[int, list[int]] = {}
    ended: set[int] = set()
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                texts.setdefault(o.index, []).extend(o.new_token_ids)
                if o.finished:
                    ended.add(o.index)
    assert ended == set(range(params.n))
    return texts


def test_forks_prefill_once_and_sample_their_own_streams(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(2))  # several full blocks and a partial one
    assert len(prompt) % engine.config.block_size != 0
    before = engine.stats().prefill_tokens_total
    out = _run(engine, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=4, n=4,
                                              ignore_eos=True))  # fmt: skip
    assert engine.stats().prefill_tokens_total - before == len(prompt)
    assert sorted(out) == [0, 1, 2, 3] and all(len(t) == 10 for t in out.values())
    assert len({tuple(t) for t in out.values()}) > 1
    again = _run(engine, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=4, n=4,
                                                ignore_eos=True))  # fmt: skip
    assert again == out  # each fork's generator is seeded (seed + index)
    # Fork i samples as a lone request seeded seed + i would.
    alone = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=6,
                                                     ignore_eos=True))[0]  # fmt: skip
    assert alone == out[2]
    assert_no_leaks(engine)


def test_greedy_forks_are_identical_and_equal_n1(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("The capital of France is")
    out = _run(engine, prompt, SamplingParams(max_tokens=8, n=3))
    single = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert out[0] == out[1] == out[2] == single
    assert_no_leaks(engine)


def test_aborting_the_group_frees_every_fork(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(long_prompt(1))
    rid = engine.add_request(
        RequestSpec(prompt, SamplingParams(max_tokens=200, n=4, ignore_eos=True))
    )
    seen: list[RequestOutput] = []
    while len({o.index for o in seen}) < 4:
        seen += [o for o in engine.step() if o.request_id == rid]
    engine.abort(rid)
    ended = [o for o in engine.step() if o.request_id == rid and o.finished]
    assert sorted(o.index for o in ended) == [0, 1, 2, 3]
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)
