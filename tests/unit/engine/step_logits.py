"""Decode steps' logits, captured per prompt, and their distance to the float32 model's:
how the fused decode's tests (test_fused_decode.py, and its LoRA rows in test_lora.py)
hold a bf16 path against float32 without asking for token agreement."""

from __future__ import annotations

from typing import Any

import torch

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import CHAT, SHORT

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def logits_per_step(
    engine: LLMEngine, prompts: list[str], adapter: str | None = None
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each prompt's greedy tokens, run alone (as `adapter`, None: the base model), and
    each decode step's logits."""
    seen: list[torch.Tensor] = []
    fused = engine.model.fused
    if fused is not None:
        decode = fused.decode
        fused.decode = lambda *a: _keep(seen, decode(*a))  # type: ignore[method-assign]
    else:
        logits = engine.model.logits
        engine.model.logits = lambda h: _keep(seen, logits(h))  # type: ignore[method-assign]
    out = []
    for p in prompts:
        seen.clear()
        ids = [engine.tokenizer.encode(p)]
        tokens = engine.generate(ids, GREEDY, None if adapter is None else [adapter])[0]
        out.append((tokens, seen[-(len(tokens) - 1) :]))  # decodes only, not the prefill
    return out


def _keep(seen: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    seen.append(logits[-1].clone())
    return logits


def distances_to_float32(
    make_engine: EngineFactory, adapter: str | None = None, lora_dir: str | None = None,
    **kw: Any,
) -> dict[str, list[float]]:  # fmt: skip
    """Relative distances of the torch and the fused bf16 decode steps' logits (engines
    of `kw`) to the float32 model's, on the parity prompts' steps whose context is
    still float32's, every run as `adapter` from `lora_dir` (all three engines).
    Checks that every decode step fused and nothing leaked."""
    prompts = SHORT[:4] + CHAT[:2]
    lora = {} if lora_dir is None else {"lora_dir": lora_dir}
    ref = logits_per_step(make_engine(**lora), prompts, adapter)
    plain = make_engine(dtype="bfloat16", decode_kernel="torch", **lora, **kw)
    fused = make_engine(dtype="bfloat16", **lora, **kw)
    assert plain.model.fused is None and fused.model.fused is not None
    runs = [logits_per_step(e, prompts, adapter) for e in (plain, fused)]
    assert fused.runner.fused_steps == sum(len(t) - 1 for t, _ in runs[1])
    errors: dict[str, list[float]] = {"torch": [], "fused": []}
    for (want, ref_steps), *pair in zip(ref, *runs, strict=True):
        for name, (got, steps) in zip(("torch", "fused"), pair, strict=True):
            same = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b),
                        len(want))  # fmt: skip
            # Steps whose context is still float32's (step i computes token i + 1); none
            # where the prefill's token already differs (same == 0).
            kept = max(same - 1, 0)
            steps_kept = zip(ref_steps[:kept], steps[:kept], strict=True)
            errors[name] += [float((s - r).norm() / r.norm()) for r, s in steps_kept]
    assert len(errors["fused"]) >= 20
    assert_no_leaks(fused)
    return errors
