"""The accuracy gate's yardsticks: reference implementations of each reduced-precision
mode, scored against transformers' own float32 exactly as the gate scores pdserve's.

The gate (`loadtest.engine.accuracy`) holds each pdserve mode to the float32 engine. This
module measures, in the same run and on the same inputs, what a reference
implementation of the same mode loses against its own float32 (`YARDSTICKS`):

- bfloat16: transformers' own bfloat16;
- int8 weights: bitsandbytes' LLM.int8() through transformers (`load_in_8bit`, its
  default outlier threshold 6.0), the method pdserve's int8 kernel follows. It keeps
  the LM head in float, where pdserve quantizes it too, so it is if anything the easier
  yardstick. bitsandbytes is the `reference` extra (`make bench` installs it); without
  it these rows are reported as not measured;
- 8-bit KV (int8, fp8 e4m3): transformers in float32 with every key and value it
  caches rounded to the format and back, with one absmax scale per token and KV head
  (`QuantizedKvCache`): finer than pdserve's scale per 16-token block, so again at
  least as accurate.

Each is scored on its perplexity of the reference text, its free-running greedy
continuations against transformers' float32 ones, and its teacher-forced agreement.
On this model transformers' bf16 continuations agree with its fp32 ones on about 0.70
of the positions free-running (docs/engine.md "Precision"): a near-tie flipped by
rounding ends the rest of a continuation's agreement, whoever computes it. The gate
holds each pdserve mode's free-running agreement to its yardstick's
(`accuracy.free_running_floor`).

Lifecycle: `python -m loadtest.engine.accuracy` calls `measure` after the gated modes (and
compares transformers' fp32 continuations with the fp32 engine's itself); each
transformers model is loaded, checked to be in the dtype asked for, scored and dropped
in turn (transformers is a test extra, imported here only).
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.precision import KvCacheDType
from loadtest.engine.sides import load_hf_model


@dataclass(frozen=True)
class Yardstick:
    """A reference implementation of one gated pdserve mode (`gated`, its `Mode.name`)."""

    name: str
    gated: str
    dtype: torch.dtype
    int8_weights: bool = False  # bitsandbytes' LLM.int8()
    kv: KvCacheDType = KvCacheDType.AUTO  # AUTO: the cache in the compute dtype


YARDSTICKS = (
    Yardstick("transformers bfloat16", "bfloat16", torch.bfloat16),
    Yardstick("bitsandbytes LLM.int8(), float32", "int8, float32", torch.float32, True),
    Yardstick("bitsandbytes LLM.int8(), bfloat16", "int8, bfloat16", torch.bfloat16, True),
    Yardstick("transformers, int8 KV per token", "kv int8", torch.float32,
              kv=KvCacheDType.INT8),
    Yardstick("transformers, fp8 e4m3 KV per token", "kv fp8_e4m3", torch.float32,
              kv=KvCacheDType.FP8_E4M3),
)  # fmt: skip


class YardstickUnavailable(RuntimeError):
    """A yardstick's library is not installed here."""


@dataclass(frozen=True)
class ReferenceScores:
    """One transformers model's perplexity of the text and greedy continuations."""

    perplexity: float
    continuations: list[list[int]]


def _fake_quantize(x: torch.Tensor, kv: KvCacheDType) -> torch.Tensor:
    """`x` ([batch, heads, tokens, head_dim]) rounded to the 8-bit format and back, with
    one absmax scale per (token, head): int8 symmetric to +-127, fp8 e4m3 to +-448."""
    top = 127.0 if kv is KvCacheDType.INT8 else 448.0
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / top
    scaled = x.float() / scale
    if kv is KvCacheDType.INT8:
        coded = scaled.round().clamp(-top, top)
    else:
        coded = scaled.to(torch.float8_e4m3fn).float()
    return (coded * scale).to(x.dtype)


def _cache_factory(kv: KvCacheDType) -> Callable[[], Any]:
    """A new transformers cache per sequence; for an 8-bit `kv`, one that stores (and
    hands attention) every key and value rounded through that format."""
    import transformers

    if kv is KvCacheDType.AUTO:
        return transformers.DynamicCache

    class QuantizedKvCache(transformers.DynamicCache):
        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = _fake_quantize(key_states, kv), _fake_quantize(value_states, kv)
            return super().update(keys, values, layer_idx, *args, **kwargs)

    return QuantizedKvCache


def _cache_keyword(model: Any) -> str:
    # transformers 5 renamed forward's `past_key_values` to `cache`; the cache object
    # is ours and filled in place, so only the keyword differs between versions.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _logits(model: Any, ids: Sequence[int], cache: Any) -> torch.Tensor:
    """Float32 logits of one sequence read whole into `cache`."""
    kv = {_cache_keyword(model): cache}
    return model(torch.tensor([list(ids)]), use_cache=True, **kv).logits[0].float()


def perplexity(model: Any, tokens: Sequence[int], new_cache: Callable[[], Any]) -> float:
    """exp of the mean negative log-likelihood of tokens[1:], from float32 logits."""
    with torch.inference_mode():
        logits = _logits(model, tokens, new_cache())[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(list(tokens[1:])))
    return math.exp(float(nll))


def continuations(
    model: Any, prompts: Sequence[Sequence[int]], n: int, new_cache: Callable[[], Any]
) -> list[list[int]]:
    """Greedy continuations of `n` tokens, one prompt at a time (no padding), by argmax
    over the raw logits with a cache from `new_cache`. Not `generate`: to run past EOS
    it needs `min_new_tokens`, which masks EOS out, where the gate's `ignore_eos` only
    keeps going after choosing it."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            cache = new_cache()
            chosen = [int(_logits(model, p, cache)[-1].argmax())]
            while len(chosen) < n:
                chosen.append(int(_logits(model, chosen[-1:], cache)[-1].argmax()))
            out.append(chosen)
    return out


def forced_agreement(
    model: Any,
    prompts: Sequence[Sequence[int]],
    ref: Sequence[Sequence[int]],
    new_cache: Callable[[], Any],
) -> float:
    """Fed each prompt plus `ref`'s continuation, the mean fraction of its positions where
    the model's top token is `ref`'s (the gate's measure, through transformers)."""
    hits = []
    with torch.inference_mode():
        for p, c in zip(prompts, ref, strict=True):
            logits = _logits(model, [*p, *c[:-1]], new_cache())[len(p) - 1 :]
            hits.append(float((logits.argmax(-1) == torch.tensor(c)).float().mean()))
    return sum(hits) / len(hits)


@dataclass(frozen=True)
class Scored:
    """One yardstick's scores against transformers' float32."""

    yardstick: Yardstick
    scores: ReferenceScores
    forced_agreement: float


@dataclass
class Reference:
    """transformers in float32 on the gate's inputs, each yardstick scored against it,
    and the yardsticks that could not run here with the reason."""

    float32: ReferenceScores
    scored: list[Scored] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # yardstick name: why


def _load(model_dir: Path, yardstick: Yardstick | None) -> Any:
    """transformers' model for `yardstick` (None: float32); RuntimeError if it loaded in
    another dtype (a version that ignores the keyword would make the comparison fp32
    against fp32), YardstickUnavailable if its library is missing."""
    dtype = torch.float32 if yardstick is None else yardstick.dtype
    if yardstick is None or not yardstick.int8_weights:
        model = load_hf_model(model_dir, dtype)
    else:
        model = _load_llm_int8(model_dir, dtype)
    got = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if got != dtype:
        raise RuntimeError(f"transformers loaded the model in {got}, asked for {dtype}")
    return model


def _load_llm_int8(model_dir: Path, dtype: torch.dtype) -> Any:
    """bitsandbytes' LLM.int8() through transformers, on the CPU."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise YardstickUnavailable("bitsandbytes is not installed: pip install -e '.[reference]'")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, device_map="cpu", attn_implementation="sdpa",
        quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True),
    )  # fmt: skip
    if not any(p.dtype == torch.int8 for p in model.parameters()):
        raise RuntimeError("bitsandbytes left no int8 weight in the model")
    return model.eval()


def measure(
    model_dir: Path,
    text: Sequence[int],
    prompts: Sequence[Sequence[int]],
    n: int,
    yardsticks: Sequence[Yardstick] = YARDSTICKS,
) -> Reference:
    """Score transformers in float32, then each yardstick (one model alive at a time)."""
    plain = _cache_factory(KvCacheDType.AUTO)
    model = _load(model_dir, None)
    fp32 = ReferenceScores(perplexity(model, text, plain), continuations(model, prompts, n, plain))
    del model
    gc.collect()
    reference = Reference(fp32)
    for y in yardsticks:
        try:
            model = _load(model_dir, y)
        except YardstickUnavailable as missing:
            reference.unavailable[y.name] = str(missing)
            continue
        new_cache = _cache_factory(y.kv)
        scores = ReferenceScores(
            perplexity(model, text, new_cache), continuations(model, prompts, n, new_cache)
        )
        forced = forced_agreement(model, prompts, fp32.continuations, new_cache)
        reference.scored.append(Scored(y, scores, forced))
        del model
        gc.collect()
    return reference
