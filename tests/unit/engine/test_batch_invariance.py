"""A request's bits depend on the request alone on the default float32 engine
(`batch_invariant auto`, which takes the tiled linear kernel and attention by rows
there): its token log-probabilities are the same floats alone and beside other requests,
prefilling and decoding beside rows of similar lengths, its prompt cut into other chunks
by the step budget, its prefix from the cache, its earlier tokens recomputed as a prompt
(what a migration or a preemption does). With `batch_invariant off` they differ, so the
test can fail.

The engines run the default step budget (256 tokens), so the longer prompts here are
cut into chunks, and differently when other prompts share a step; each run keys its
prefix-cache blocks on its own salt unless a test shares one on purpose."""

from __future__ import annotations

import itertools

import pytest

from engine.attention import TorchAttention
from engine.engine import LLMEngine
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from loadtest.engine.workload import PhasePlan, make_workload
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT, long_prompt

TOKENS = 12
SALTS = (f"run-{i}" for i in itertools.count())


def _logprobs(
    engine: LLMEngine,
    prompts: list[str] | list[list[int]],
    which: int = 0,
    *,
    salt: str | None = None,
    tokens: int = TOKENS,
) -> list[float]:
    """Prompt `which`'s sampled-token log-probabilities, the prompts run together (under
    a fresh cache salt unless given one: no prefix-cache hits on earlier runs)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0)
    salt = salt or next(SALTS)
    ids = [
        engine.add_request(RequestSpec(_ids(engine, p), params, cache_salt=salt)) for p in prompts
    ]
    got: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == ids[which]:
                got += [lp.chosen.logprob for lp in out.logprobs]
    assert len(got) == tokens
    return got


def _ids(engine: LLMEngine, prompt: str | list[int]) -> list[int]:
    return engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


@pytest.fixture(scope="module")
def engines(make_engine: EngineFactory) -> dict[str, LLMEngine]:
    """float32 engines at the default step budget, the default and one with batch
    invariance off."""
    settings = {"kv_cache_bytes": 128 << 20}
    return {
        "default": make_engine(**settings),
        "off": make_engine(batch_invariant="off", **settings),
    }


def test_rows_do_not_depend_on_their_batch(engines: dict[str, LLMEngine]) -> None:
    tiled = engines["default"]
    assert tiled.model.kernel.name == "tiled"
    prompt = long_prompt(3)  # over the step budget: cut into chunks, differently beside others
    assert len(tiled.tokenizer.encode(prompt)) > 256
    alone = _logprobs(tiled, [prompt])
    assert _logprobs(tiled, [SHORT[1], prompt, *SHORT[2:6]], which=1) == alone
    assert _logprobs(tiled, [*SHORT[6:9], long_prompt(2), prompt], which=4) == alone
    assert_no_leaks(tiled)


def test_with_invariance_off_rows_depend_on_their_batch(engines: dict[str, LLMEngine]) -> None:
    default = engines["off"]
    assert default.model.kernel.name != "tiled"
    prompt = long_prompt(3)
    alone = _logprobs(default, [prompt])
    together = _logprobs(default, [SHORT[1], prompt, *SHORT[2:6]], which=1)
    assert together != alone  # what the tiled kernel fixes: see engine.invariance
    assert_no_leaks(default)


def test_decode_rows_of_similar_lengths_each_keep_their_bits(
    engines: dict[str, LLMEngine],
) -> None:
    """Prompts within 1.5x of each other's length decode side by side: without
    invariance their rows share one attention product padded to the longest."""
    engine = engines["default"]
    plan = PhasePlan(4, 4, prompt_range=(120, 170), output_range=(24, 24))
    requests = make_workload(plan, engine.tokenizer.vocab_size, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)

    def run(batch: list[list[int]]) -> list[list[float]]:
        salt = next(SALTS)
        ids = [engine.add_request(RequestSpec(p, params, cache_salt=salt)) for p in batch]
        got: dict[str, list[float]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += [lp.chosen.logprob for lp in out.logprobs]
        return [got[i] for i in ids]

    prompts = [list(r.prompt) for r in requests]
    assert run(prompts) == [run([p])[0] for p in prompts]
    assert_no_leaks(engine)


def test_a_prefix_from_the_cache_gives_the_bits_of_computing_it(
    engines: dict[str, LLMEngine],
) -> None:
    """The second prompt starts its prefill where the first one's cached blocks end,
    mid-chunk: its rows are computed in other calls than when it runs alone."""
    engine = engines["default"]
    prompt = engine.tokenizer.encode(long_prompt(3))
    alone = _logprobs(engine, [prompt])
    salt = next(SALTS)
    _logprobs(engine, [prompt[:150] + prompt[:20]], salt=salt)  # caches 9 blocks of prompt
    hits = engine.scheduler.prefix_hit_tokens
    assert _logprobs(engine, [prompt], salt=salt) == alone
    assert engine.scheduler.prefix_hit_tokens - hits == 144
    assert_no_leaks(engine)


def test_tokens_recomputed_as_a_prompt_keep_their_bits(engines: dict[str, LLMEngine]) -> None:
    """A migrated or preempted stream's output is computed again as part of a prompt:
    its tokens' KV must carry the bits their decode steps gave them."""
    engine = engines["default"]
    prompt = engine.tokenizer.encode(long_prompt(2))
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    rid = engine.add_request(RequestSpec(prompt, params, cache_salt=next(SALTS)))
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += [lp.chosen.token_id for lp in out.logprobs]
                logprobs += [lp.chosen.logprob for lp in out.logprobs]
    half = TOKENS // 2
    resumed = _logprobs(engine, [prompt + tokens[:half]], tokens=TOKENS - half)
    assert resumed == logprobs[half:]
    assert_no_leaks(engine)


def test_invariant_attention_never_groups_decode_rows() -> None:
    lens = [100, 101, 120, 400]
    assert TorchAttention(invariant=True)._buckets(lens) == [[0], [1], [2], [3]]
    assert TorchAttention()._buckets(lens) == [[0, 1, 2], [3]]
