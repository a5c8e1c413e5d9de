"""The accuracy gate's yardstick: transformers' own bfloat16 against its own float32.

The gate (`loadtest.engine.accuracy`) holds each pdserve mode to the float32 engine. This
module measures, in the same run and on the same inputs, what the reference
implementation itself loses in bfloat16: its perplexity of the reference text, its
free-running greedy continuations against its float32 ones, and its teacher-forced
agreement. It is not a gate; it says which of the gate's numbers a bf16 model can be
asked for at all. On this model transformers' bf16 continuations agree with its fp32
ones on about 0.70 of the positions free-running (docs/engine.md "Precision"): a
near-tie flipped by rounding ends the rest of a continuation's agreement, whoever
computes it.

Lifecycle: `python -m loadtest.engine.accuracy` calls `measure` after the gated modes (and
compares transformers' fp32 continuations with the fp32 engine's itself); each
transformers model is loaded, checked to be in the dtype asked for, scored and dropped
in turn (transformers is a test extra, imported here only).
"""

from __future__ import annotations

import gc
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loadtest.engine.sides import load_hf_model

NAME = "transformers bfloat16 vs its float32 (not gated)"


@dataclass(frozen=True)
class ReferenceScores:
    """One transformers model's perplexity of the text and greedy continuations."""

    perplexity: float
    continuations: list[list[int]]


def perplexity(model: Any, tokens: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of tokens[1:], from float32 logits."""
    with torch.inference_mode():
        logits = model(torch.tensor([list(tokens)])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(list(tokens[1:])))
    return math.exp(float(nll))


def continuations(model: Any, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Greedy continuations of `n` tokens, one prompt at a time (no padding), by argmax
    over the raw logits with transformers' KV cache. Not `generate`: to run past EOS it
    needs `min_new_tokens`, which masks EOS out, where the gate's `ignore_eos` only
    keeps going after choosing it."""
    import transformers

    # transformers 5 renamed forward's `past_key_values` to `cache`; the cache object
    # is ours and filled in place, so only the keyword differs between versions.
    keyword = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    out = []
    with torch.inference_mode():
        for p in prompts:
            kv = {keyword: transformers.DynamicCache()}
            logits = model(torch.tensor([list(p)]), use_cache=True, **kv).logits
            chosen = [int(logits[0, -1].argmax())]
            while len(chosen) < n:
                logits = model(torch.tensor([chosen[-1:]]), use_cache=True, **kv).logits
                chosen.append(int(logits[0, -1].argmax()))
            out.append(chosen)
    return out


def forced_agreement(
    model: Any, prompts: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]
) -> float:
    """Fed each prompt plus `ref`'s continuation, the mean fraction of its positions where
    the model's top token is `ref`'s (the gate's measure, through transformers)."""
    hits = []
    with torch.inference_mode():
        for p, c in zip(prompts, ref, strict=True):
            logits = model(torch.tensor([[*p, *c[:-1]]])).logits[0, len(p) - 1 :]
            hits.append(float((logits.argmax(-1) == torch.tensor(c)).float().mean()))
    return sum(hits) / len(hits)


@dataclass(frozen=True)
class Reference:
    """transformers in float32 and in bfloat16 on the gate's inputs, and bfloat16's
    teacher-forced agreement with float32's continuations."""

    float32: ReferenceScores
    bfloat16: ReferenceScores
    forced_agreement: float


def _load(model_dir: Path, dtype: torch.dtype) -> Any:
    """transformers' model in `dtype`; RuntimeError if it loaded in another (a version
    that ignores the keyword would make the comparison fp32 against fp32)."""
    model = load_hf_model(model_dir, dtype)
    got = next(model.parameters()).dtype
    if got != dtype:
        raise RuntimeError(f"transformers loaded the model in {got}, asked for {dtype}")
    return model


def measure(
    model_dir: Path, text: Sequence[int], prompts: Sequence[Sequence[int]], n: int
) -> Reference:
    """Score transformers in float32, then in bfloat16 (one model alive at a time)."""
    model = _load(model_dir, torch.float32)
    fp32 = ReferenceScores(perplexity(model, text), continuations(model, prompts, n))
    del model
    gc.collect()
    model = _load(model_dir, torch.bfloat16)
    bf16 = ReferenceScores(perplexity(model, text), continuations(model, prompts, n))
    forced = forced_agreement(model, prompts, fp32.continuations)
    del model
    gc.collect()
    return Reference(fp32, bf16, forced)
