"""Log-probabilities from the engine equal a float32 HF transformers log-softmax of the same
tokens within 1e-3: the sampled tokens' (with their top N and rank) and the prompt's
(`prompt_logprobs`, across chunked prefill and without prefix-cache hits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import LLMEngine
from engine.request import RequestOutput
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import long_prompt

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    # A small token budget: a long prompt's prefill takes several chunks.
    return make_engine(kv_cache_bytes=128 << 20, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    rid = engine.add_request(RequestSpec(prompt, params))
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_token_and_prompt_logprobs_equal_hf(engine: LLMEngine, hf: torch.nn.Module) -> None:
    prompt = engine.tokenizer.encode(long_prompt(2))
    assert len(prompt) > 3 * 64  # several prefill chunks
    # Cache the prompt first: a prompt_logprobs request must still compute every position.
    engine.generate([prompt], SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=2)
    outs = _run(engine, prompt, params)
    output = [t for o in outs for t in o.new_token_ids]
    ref = _reference(hf, prompt + output)
    prompt_lps = outs[0].prompt_logprobs
    assert len(prompt_lps) == len(prompt) - 1
    assert all(not o.prompt_logprobs for o in outs[1:])
    for i, lp in enumerate(prompt_lps):
        assert lp.chosen.token_id == prompt[i + 1]
        assert abs(lp.chosen.logprob - float(ref[i, prompt[i + 1]])) < TOLERANCE
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
        assert lp.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
    token_lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.chosen.token_id for lp in token_lps] == output
    for k, lp in enumerate(token_lps):
        row = ref[len(prompt) - 1 + k]
        assert abs(lp.chosen.logprob - float(row[output[k]])) < TOLERANCE
        top = row.topk(3)
        assert [t.token_id for t in lp.top] == top.indices.tolist()  # greedy: rank 1 first
        assert lp.rank == 1 and lp.top[0].token_id == output[k]
        assert all(
            abs(t.logprob - v) < TOLERANCE for t, v in zip(lp.top, top.values.tolist(), strict=True)
        )
    assert_no_leaks(engine)


def test_requests_without_logprobs_carry_none(engine: LLMEngine) -> None:
    outs = _run(engine, engine.tokenizer.encode("Hello there"), SamplingParams(max_tokens=3))
    assert all(o.logprobs == () and o.prompt_logprobs == () for o in outs)
