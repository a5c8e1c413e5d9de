"""A request's bits depend on the request alone on the default float32 engine
(`batch_invariant auto`, which takes the tiled linear kernel there): its token
log-probabilities are the same floats alone, beside other requests, with its prompt cut
into other chunks, and from a prefix cache hit. With `batch_invariant off` (oneDNN) they
differ, so the test can fail."""

from __future__ import annotations

import pytest

from engine.engine import LLMEngine
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT, long_prompt

TOKENS = 12


def _logprobs(engine: LLMEngine, prompts: list[str], which: int = 0) -> list[float]:
    """Prompt `which`'s sampled-token log-probabilities, the prompts run together."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(RequestSpec(engine.tokenizer.encode(p), params)) for p in prompts]
    got: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == ids[which]:
                got += [lp.chosen.logprob for lp in out.logprobs]
    assert len(got) == TOKENS
    return got


@pytest.fixture(scope="module")
def engines(make_engine: EngineFactory) -> dict[str, LLMEngine]:
    """float32 engines: the default with 256- and 48-token prefill chunks, and one with
    batch invariance off."""
    settings = {"kv_cache_bytes": 128 << 20}
    return {
        "default": make_engine(max_num_batched_tokens=256, **settings),
        "small-chunks": make_engine(max_num_batched_tokens=48, **settings),
        "off": make_engine(batch_invariant="off", max_num_batched_tokens=256, **settings),
    }


def test_rows_do_not_depend_on_batch_chunking_or_cache(engines: dict[str, LLMEngine]) -> None:
    tiled, chunks = engines["default"], engines["small-chunks"]
    assert tiled.model.kernel.name == "tiled"
    prompt = long_prompt(1)
    alone = _logprobs(tiled, [prompt])
    assert _logprobs(tiled, [SHORT[1], prompt, *SHORT[2:6]], which=1) == alone  # batched, cached
    assert _logprobs(chunks, [prompt]) == alone  # 48-token chunks, not 256
    assert _logprobs(chunks, [SHORT[3], prompt, SHORT[4]], which=1) == alone
    for engine in (tiled, chunks):
        assert_no_leaks(engine)


def test_with_invariance_off_rows_depend_on_their_batch(engines: dict[str, LLMEngine]) -> None:
    default = engines["off"]
    assert default.model.kernel.name != "tiled"
    prompt = long_prompt(1)
    alone = _logprobs(default, [prompt])
    together = _logprobs(default, [SHORT[1], prompt, *SHORT[2:6]], which=1)
    assert together != alone  # what the tiled kernel fixes: see engine.invariance
    assert_no_leaks(default)
