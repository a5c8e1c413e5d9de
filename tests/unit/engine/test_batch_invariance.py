"""A request's bits depend on the request alone on the default float32 engine
(`batch_invariant auto`, which takes the tiled linear kernel and per-row decode attention
there): its token log-probabilities are the same floats alone and beside other requests,
prefilling and decoding beside rows of similar lengths. With `batch_invariant off` they
differ, so the test can fail.

The engines' step budget holds every prompt whole, and each run keys its prefix-cache
blocks on its own salt: a prompt cut at other chunk boundaries (another budget, other
prompts sharing it, a prefix-cache hit) computes its rows in attention calls of other
shapes, which can move their last bits (the gap left, docs/engine.md "Batch
invariance")."""

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


def _logprobs(engine: LLMEngine, prompts: list[str], which: int = 0) -> list[float]:
    """Prompt `which`'s sampled-token log-probabilities, the prompts run together (under
    a fresh cache salt: no prefix-cache hits on earlier runs)."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    salt = next(SALTS)
    ids = [
        engine.add_request(RequestSpec(engine.tokenizer.encode(p), params, cache_salt=salt))
        for p in prompts
    ]
    got: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == ids[which]:
                got += [lp.chosen.logprob for lp in out.logprobs]
    assert len(got) == TOKENS
    return got


@pytest.fixture(scope="module")
def engines(make_engine: EngineFactory) -> dict[str, LLMEngine]:
    """float32 engines, the default and one with batch invariance off, whose step budget
    holds every prompt of these tests whole."""
    settings = {"kv_cache_bytes": 128 << 20, "max_num_batched_tokens": 1024}
    return {
        "default": make_engine(**settings),
        "off": make_engine(batch_invariant="off", **settings),
    }


def test_rows_do_not_depend_on_their_batch(engines: dict[str, LLMEngine]) -> None:
    tiled = engines["default"]
    assert tiled.model.kernel.name == "tiled"
    prompt = long_prompt(1)
    alone = _logprobs(tiled, [prompt])
    assert _logprobs(tiled, [SHORT[1], prompt, *SHORT[2:6]], which=1) == alone
    assert _logprobs(tiled, [*SHORT[6:9], prompt], which=3) == alone
    assert_no_leaks(tiled)


def test_with_invariance_off_rows_depend_on_their_batch(engines: dict[str, LLMEngine]) -> None:
    default = engines["off"]
    assert default.model.kernel.name != "tiled"
    prompt = long_prompt(1)
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


def test_invariant_attention_never_groups_decode_rows() -> None:
    lens = [100, 101, 120, 400]
    assert TorchAttention(invariant=True)._buckets(lens) == [[0], [1], [2], [3]]
    assert TorchAttention()._buckets(lens) == [[0, 1, 2], [3]]
