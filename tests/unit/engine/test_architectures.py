"""The architecture paths the README claims, against HF transformers on tiny random models.

Llama-3 RoPE scaling, Qwen2's q/k/v biases and Llama's attention and MLP biases (the
models are built in tests/tiny_models.py): the engine's logits at every generated position
match transformers' in float32 and its greedy tokens are transformers' argmax, for one
request prefilled in chunks and for a batch. Prompts run past the Llama-3 model's original
context (32 tokens), into the positions its scaling is for. Each path also shows that it
matters: the same weights without it give logits far outside the tolerance, so a test
against a reference without the path would fail.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.model_spec import ModelSpec, RopeScaling
from engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.tiny_models import (
    ARCHITECTURES,
    LLAMA3_ROPE,
    ORIGINAL_CONTEXT,
    VOCAB_SIZE,
    without_feature,
    write_tiny_model,
)

pytest.importorskip("transformers")

PROMPT_LEN = 72
MAX_TOKENS = 16
ATOL = 1e-4
# What ModelSpec must read from each architecture's config.json.
EXPECTED_SPEC: dict[str, dict[str, object]] = {
    "llama3": {
        "model_type": "llama",
        "rope_scaling": RopeScaling(8.0, 1.0, 4.0, ORIGINAL_CONTEXT),
        "qkv_bias": False,
        "o_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "rope_scaling": None,
        "qkv_bias": True,
        "o_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    },
    "llama_bias": {
        "model_type": "llama",
        "rope_scaling": None,
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class Tiny:
    arch: str
    model_dir: Path
    hf: Any  # the transformers model the directory was saved from


@pytest.fixture(scope="module")
def tinies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {a: Tiny(a, root / a, write_tiny_model(a, root / a)) for a in ARCHITECTURES}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request: pytest.FixtureRequest, tinies: dict[str, Tiny]) -> Tiny:
    return tinies[request.param]


def _engine(model_dir: Path) -> LLMEngine:
    # A 32-token step budget splits every long prompt into chunks, across position 32.
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            kv_cache_bytes=1 << 20,
            max_num_batched_tokens=32,
        )
    )


@pytest.fixture(scope="module")
def engine(tiny: Tiny) -> LLMEngine:
    return _engine(tiny.model_dir)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB_SIZE, (length,), generator=gen).tolist()


def _run(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, prompt: list[int], *, fused: bool = False
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one request and the logits row each was sampled from (`fused`:
    only the rows of the fused decode's steps)."""
    rows: list[torch.Tensor] = []
    owner: Any = engine.model.fused if fused else engine.model
    name = "decode" if fused else "logits"
    logits = getattr(owner, name)

    def capture(*args: Any) -> torch.Tensor:
        out: torch.Tensor = logits(*args)
        rows.append(out.clone())
        return out

    monkeypatch.setattr(owner, name, capture)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    (tokens,) = engine.generate([prompt], params)
    monkeypatch.undo()
    return tokens, torch.cat(rows)


def _reference(hf: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits at the positions that predict each of `output`'s tokens."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : -1].float()


def test_spec_reads_each_architecture(tiny: Tiny) -> None:
    spec = ModelSpec.from_dir(tiny.model_dir)
    assert {k: getattr(spec, k) for k in EXPECTED_SPEC[tiny.arch]} == EXPECTED_SPEC[tiny.arch]
    # The saved biases are the random ones, not transformers' zero init.
    weights = load_file(str(tiny.model_dir / "model.safetensors"))
    saved = [t for name, t in weights.items() if name.endswith(".bias")]
    assert len(saved) == {"llama3": 0, "qwen2": 2 * 3, "llama_bias": 2 * 7}[tiny.arch]
    assert all(t.abs().max() > 0.5 for t in saved)
    assert ("lm_head.weight" in weights) == (not spec.tie_word_embeddings)


def test_logits_and_greedy_tokens_match_transformers(
    tiny: Tiny, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = _prompt(1, PROMPT_LEN)
    tokens, got = _run(engine, monkeypatch, prompt)
    ref = _reference(tiny.hf, prompt, tokens)
    assert got.shape == (MAX_TOKENS, VOCAB_SIZE)
    assert tokens == ref.argmax(-1).tolist()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)
    assert_no_leaks(engine)


def test_without_the_path_the_logits_differ(
    tiny: Tiny, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = _prompt(2, PROMPT_LEN)
    tokens, got = _run(engine, monkeypatch, prompt)
    plain = _reference(without_feature(tiny.arch, tiny.hf), prompt, tokens)
    assert (got - plain).abs().max() > 1000 * ATOL
    # Not just a nudge: most greedy choices change.
    assert (plain.argmax(-1) != torch.tensor(tokens)).sum() >= MAX_TOKENS // 2
    assert_no_leaks(engine)


def test_fused_decode_takes_each_architectures_path(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bfloat16 the fused decode (`engine/fused_decode.py`) runs every decode step,
    and its logits are as near transformers' float32 ones as the torch bf16 path's:
    a bias or rotary scaling it missed would put them as far off as the model without
    that path (see the test above), thousands of times further."""
    prompt = _prompt(3, PROMPT_LEN)
    errors: dict[str, float] = {}
    for kernel in ("torch", "fused"):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny.model_dir),
                dtype="bfloat16",
                decode_kernel=kernel,
                kv_cache_bytes=1 << 20,
                max_num_batched_tokens=32,
            )
        )
        tokens, got = _run(engine, monkeypatch, prompt, fused=kernel == "fused")
        assert engine.runner.fused_steps == (MAX_TOKENS - 1 if kernel == "fused" else 0)
        ref = _reference(tiny.hf, prompt, tokens)[1:]  # the decode steps' positions
        errors[kernel] = float((got[-(MAX_TOKENS - 1) :] - ref).abs().max() / ref.abs().max())
        assert_no_leaks(engine)
    assert errors["fused"] <= max(1.5 * errors["torch"], 0.01), errors


def test_batch_with_chunked_prefill_matches_transformers(tiny: Tiny, engine: LLMEngine) -> None:
    prompts = [_prompt(10 + i, n) for i, n in enumerate((5, 31, 33, 90))]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert len(tokens) == MAX_TOKENS
        ref = _reference(tiny.hf, prompt, tokens)
        assert tokens == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens diverged"
    assert_no_leaks(engine)


def test_rope_scaling_in_the_older_config_spelling(
    tinies: dict[str, Tiny], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama 3 checkpoints on the Hub (and transformers 4) write `rope_scaling` with
    `rope_theta` beside it; transformers 5 writes `rope_parameters`. Both load alike."""
    tiny = tinies["llama3"]
    legacy = tmp_path / "legacy"
    shutil.copytree(tiny.model_dir, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    assert params == {**LLAMA3_ROPE, "rope_theta": 10000.0}
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (legacy / "config.json").write_text(json.dumps(cfg))
    new, old = ModelSpec.from_dir(tiny.model_dir), ModelSpec.from_dir(legacy)
    assert dataclasses.replace(old, fingerprint=new.fingerprint) == new
    eng = _engine(legacy)
    prompt = _prompt(3, PROMPT_LEN)
    tokens, got = _run(eng, monkeypatch, prompt)
    torch.testing.assert_close(got, _reference(tiny.hf, prompt, tokens), atol=ATOL, rtol=ATOL)
    assert_no_leaks(eng)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear"])
def test_other_rope_scaling_is_refused(tinies: dict[str, Tiny], rope_type: str) -> None:
    cfg = json.loads((tinies["llama3"].model_dir / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = rope_type
    with pytest.raises(InvalidRequestError, match="rope scaling must be none or llama3"):
        ModelSpec.from_config(cfg, fingerprint="")
