"""Random LoRA adapters written by PEFT itself, and PEFT's own outputs as the reference.

Lifecycle: `write_adapter(base, path, recipe)` wraps a copy of a transformers model in a
PEFT LoRA of `recipe` (seeded random A and B, B scaled so the adapter changes the
output without drowning the model), saves it with `save_pretrained` (the format the
engine reads) and returns the PEFT model; `peft_greedy(model, prompts, n)` is the
reference continuations. Two recipes cover every projection an adapter may target:
"alpha" (q and v, rank 8) and "beta" (k, o, gate, up, down; rank 4, rsLoRA).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Recipe:
    targets: tuple[str, ...]
    rank: int
    alpha: int
    rslora: bool = False
    seed: int = 0
    b_scale: float = 0.25  # B's random init scaled down: a nudge, not a new model


RECIPES = {
    "alpha": Recipe(("q_proj", "v_proj"), rank=8, alpha=16, seed=1),
    "beta": Recipe(
        ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 4, 8, rslora=True, seed=2
    ),
    "gamma": Recipe(("q_proj", "o_proj", "down_proj"), rank=8, alpha=8, seed=3),
    "delta": Recipe(("v_proj", "up_proj"), rank=16, alpha=16, seed=4),
}


def write_adapter(base: Any, path: Path, recipe: Recipe) -> Any:
    """Save a random adapter of `recipe` for `base` into `path`; returns the PEFT model
    (on a deep copy of `base`, float32, eval mode)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=recipe.rank,
        lora_alpha=recipe.alpha,
        target_modules=list(recipe.targets),
        use_rslora=recipe.rslora,
        lora_dropout=0.0,
        init_lora_weights=False,  # random A and B (PEFT's default B is zero)
    )
    torch.manual_seed(recipe.seed)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(recipe.b_scale)
    model.save_pretrained(str(path))
    return model.float().eval()


def peft_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, cut after EOS."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=2,
            )
            tokens = ids[0, len(p) :].tolist()
            out.append(tokens[: tokens.index(2) + 1] if 2 in tokens else tokens)
    return out
