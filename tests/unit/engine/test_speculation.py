"""Speculative decoding (`engine/speculation.py`): the n-gram drafter, the acceptance rule,
and the engine with it on. Output is unchanged: greedy and seeded streams are
token-identical with speculation on and off (alone and batched, with stops, max_tokens
and penalties), and the sampled next-token distribution is the target's (a chi-square
test that a deliberately wrong rule fails). Every engine test ends with a leak check,
which also asks that no ended request's draft state is left."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch

from engine import output_stage
from engine.config import SpecConfig, SpecMode
from engine.engine import LLMEngine
from engine.request import Request
from engine.request_spec import RequestSpec
from engine.sampler import new_generator, sample
from engine.sampling_params import SamplingParams
from engine.speculation import NgramIndex, Speculator, accepted
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT

# A document the answer copies: prompt lookup drafts it.
DOC = (
    "The committee met on Tuesday to review the budget, and agreed that the new library "
    "would open in March, with longer hours on weekends and a reading room for children."
)
COPY = f"Repeat the following text exactly.\n\nText: {DOC}\n\nRepeated text:"
ALPHA = 0.001  # significance level of the chi-square tests


@pytest.fixture(scope="module")
def engines(make_engine: EngineFactory) -> dict[str, LLMEngine]:
    # Room for the distribution test's 80 requests in one batch.
    common = {"kv_cache_bytes": 256 << 20, "max_num_batched_tokens": 1024, "max_num_seqs": 160}
    return {
        mode: make_engine(speculative_decoding=mode, **common) for mode in ("off", "on", "auto")
    }


# -- the drafter and the rule ----------------------------------------------------------


def test_ngram_index_drafts_what_followed_the_suffix_before() -> None:
    index = NgramIndex(2, 3)
    index.extend([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert index.draft(3) == [8, 9, 1]  # "5 6 7" ended at 3 before: 8 9 1 followed
    assert index.draft(1) == [8]
    index.extend([2])
    assert index.draft(3) == []  # "6 7 2", "7 2" never occurred before
    index.extend([5, 6])
    assert index.draft(2) == [7, 2]  # the latest earlier occurrence of "5 6" wins


def test_a_single_token_match_is_not_a_draft() -> None:
    index = NgramIndex(2, 3)
    index.extend([4, 1, 2, 3, 4])
    assert index.draft(2) == []


def test_accepted_keeps_drafts_to_the_first_mismatch_then_the_sample() -> None:
    assert accepted([7, 8, 9], [7, 8]) == [7, 8, 9]  # all kept, plus the bonus sample
    assert accepted([7, 5, 9], [7, 8]) == [7, 5]  # the sample replaces the first miss
    assert accepted([3, 8, 9], [7, 8]) == [3]
    assert accepted([4], []) == [4]


def test_auto_adapts_the_draft_length_and_pauses_a_failing_request() -> None:
    spec = Speculator(SpecConfig(mode=SpecMode.AUTO, max_draft=4, max_batch=2))
    r = Request("r", [5, 6, 7, 8, 5, 6, 7], SamplingParams(max_tokens=50), 0)
    spec.propose([r])
    assert r.draft_token_ids == [8, 5, 6, 7]
    spec.record(r, 4, 1)
    assert spec.states["r"].draft_len == 2  # one kept: try two next
    for _ in range(6):
        spec.record(r, 2, 0)
    assert spec.states["r"].paused == spec.config.pause_steps
    r.draft_token_ids = []
    spec.propose([r])
    assert r.draft_token_ids == []  # sits out
    many = [Request(f"m{i}", [1, 2, 1, 2], SamplingParams(max_tokens=9), 0) for i in range(3)]
    spec.propose(many)
    assert all(not m.draft_token_ids for m in many)  # more decodes than max_batch: none
    spec.forget("r")
    assert "r" not in spec.states


# -- exactness in distribution ---------------------------------------------------------


def _pooled(observed: list[list[int]], expected: list[list[float]]) -> float:
    """Chi-square p-value of observed against expected counts (rows of categories); the
    categories expecting under 5 draws in any row are pooled into one."""
    small = [j for j in range(len(expected[0])) if min(row[j] for row in expected) < 5]
    big = [j for j in range(len(expected[0])) if j not in small]
    stat, cells = 0.0, 0
    for obs, exp in zip(observed, expected, strict=True):
        pairs = [(obs[j], exp[j]) for j in big]
        if small:
            pairs.append((sum(obs[j] for j in small), sum(exp[j] for j in small)))
        stat += sum((o - e) ** 2 / e for o, e in pairs)
        cells = len(pairs)
    dof = (cells - 1) * max(1, len(observed) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def _fit_p(observed: Sequence[int], probs: Sequence[float]) -> float:
    """Goodness of fit of counts to probabilities."""
    n = sum(observed)
    return _pooled([list(observed)], [[n * q for q in probs]])


def _homogeneity_p(a: Counter[int], b: Counter[int]) -> float:
    """Test of homogeneity: two samples of equal size from one distribution."""
    tokens = sorted(set(a) | set(b))
    half = [(a[t] + b[t]) / 2 for t in tokens]
    return _pooled([[a[t] for t in tokens], [b[t] for t in tokens]], [half, half])


Rule = Callable[[Sequence[int], Sequence[int]], list[int]]


def _always_keep(samples: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """A wrong rule: every draft kept, whatever the model says."""
    return [*drafts, samples[len(drafts)]]


@pytest.mark.parametrize(("rule", "exact"), [(accepted, True), (_always_keep, False)])
def test_the_emitted_token_follows_the_target_distribution(rule: Rule, exact: bool) -> None:
    """Synthetic logits, one draft token: the first emitted token over 20,000 seeded draws
    against the target's own probabilities, at significance ALPHA."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.3, 0.2, 0.1, 0.0, -0.5, 0.4]])
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    draft = 1  # a token of middling probability: neither always kept nor never
    draws = 20_000
    counts: Counter[int] = Counter()
    for seed in range(draws):
        gens = [new_generator(seed * 2), new_generator(seed * 2 + 1)]
        samples = sample(logits, [params, params], list(gens))
        counts[rule(samples, [draft])[0]] += 1
    probs = logits[0].softmax(-1).tolist()
    p = _fit_p([counts[t] for t in range(6)], probs)
    assert (p > ALPHA) is exact, (p, counts)


def test_seeded_next_token_distribution_is_unchanged_by_speculation(
    engines: dict[str, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's test, on the model: for one repetitive context, the token at the first
    verified position over many seeds with speculation on matches it without (a
    chi-square test of homogeneity at ALPHA), and a deliberately wrong rule fails it."""
    off, on = engines["off"], engines["on"]
    prompt = on.tokenizer.encode(COPY + " " + " ".join(DOC.split()[:8]))  # at a word's end
    seeds = range(80)

    def second_tokens(eng: LLMEngine) -> Counter[int]:
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
                  for s in seeds]  # fmt: skip
        eng.generate([prompt], SamplingParams(max_tokens=1))  # its full blocks cached once
        outs: dict[str, list[int]] = {}
        for p in params:
            outs[eng.add_request(RequestSpec(prompt, p))] = []
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] += o.new_token_ids
        return Counter(tokens[1] for tokens in outs.values())

    without, before = second_tokens(off), on.speculator.verifications_total
    with_spec = second_tokens(on)
    assert on.speculator.verifications_total - before > len(seeds) // 2  # drafts were verified
    assert _homogeneity_p(without, with_spec) > ALPHA
    monkeypatch.setattr(output_stage, "accepted", _always_keep)
    wrong = second_tokens(on)
    assert _homogeneity_p(without, wrong) < ALPHA, (without, wrong)
    assert_no_leaks(on)


# -- token identity --------------------------------------------------------------------


CASES = {
    "greedy": SamplingParams(max_tokens=24),
    "seeded": SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3),
    "penalised": SamplingParams(
        max_tokens=24,
        temperature=0.7,
        seed=9,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        min_tokens=20,
    ),
    "stops": SamplingParams(max_tokens=24, stop=["Tuesday"], stop_token_ids=[30]),
    "short": SamplingParams(max_tokens=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculation_leaves_batched_output_token_identical(
    engines: dict[str, LLMEngine], name: str
) -> None:
    params = CASES[name]
    prompts = [engines["off"].tokenizer.encode(t) for t in (COPY, SHORT[1])]
    want = engines["off"].generate(prompts, params)
    for mode in ("on", "auto"):
        assert engines[mode].generate(prompts, params) == want, mode
        assert_no_leaks(engines[mode])


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_speculation_leaves_output_alone_token_identical(
    engines: dict[str, LLMEngine], name: str
) -> None:
    params = CASES[name]
    prompt = engines["off"].tokenizer.encode(COPY)
    before = engines["on"].speculator.accepted_total
    assert engines["on"].generate([prompt], params) == engines["off"].generate([prompt], params)
    assert engines["on"].speculator.accepted_total > before  # it did speculate, and keep
    assert_no_leaks(engines["on"])


def test_a_copying_answer_takes_fewer_steps(engines: dict[str, LLMEngine]) -> None:
    """More than one token per step on a copy task: the point of it all."""
    eng = engines["on"]
    prompt = eng.tokenizer.encode(COPY)
    before = (eng.stats().decode_steps_total, eng.stats().decode_tokens_total)
    eng.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    steps = eng.stats().decode_steps_total - before[0]
    tokens = eng.stats().decode_tokens_total - before[1]
    assert tokens == 32 and steps < 24, (steps, tokens)
    assert_no_leaks(eng)


def test_an_abort_mid_verification_frees_blocks_and_draft_state(
    engines: dict[str, LLMEngine],
) -> None:
    eng = engines["on"]
    rid = eng.add_request(RequestSpec(eng.tokenizer.encode(COPY), SamplingParams(max_tokens=60)))
    for _ in range(4):
        eng.step()
    assert rid in eng.speculator.states
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(eng)


def test_drafts_past_the_token_budget_wait_for_a_later_step(make_engine: EngineFactory) -> None:
    """Three decodes of five tokens each (one plus four drafts, forced) do not fit an
    8-token step: the decodes that do not fit run later, without their drafts, and the
    output is unchanged."""
    tight = make_engine(kv_cache_bytes=64 << 20, max_num_batched_tokens=8,
                        speculative_decoding="on")  # fmt: skip
    off = make_engine(kv_cache_bytes=64 << 20, max_num_batched_tokens=8)

    def four_drafts(decodes: Sequence[Request]) -> None:
        for req in decodes:
            room = req.sampling.max_tokens - len(req.output_token_ids) - 1
            req.draft_token_ids = [req.output_token_ids[-1]] * max(0, min(4, room))

    tight.speculator.propose = four_drafts  # type: ignore[method-assign]
    prompts = [[1, 17], [1, 42], [1, 99]]  # prefilled in one step: they decode together
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert tight.generate(prompts, params) == off.generate(prompts, params)
    assert tight.speculator.drafted_total > 0
    assert_no_leaks(tight)
