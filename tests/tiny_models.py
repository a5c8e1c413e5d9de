"""Tiny randomly initialised HF models of each architecture the engine claims, for tests.

Lifecycle: `write_tiny_model(arch, path)` builds a transformers model from a fixed seed,
saves it in HF layout (config.json, model.safetensors) together with an offline word-level
tokenizer.json, and returns the float32 model in eval mode as the reference to compare
with. Each architecture exercises the path that sets it apart:

- "llama3": Llama with Llama-3 RoPE scaling (`rope_type: llama3`) whose original context
  (32) is shorter than the prompts, untied LM head;
- "qwen2": Qwen2 with q/k/v biases, tied embeddings;
- "llama_bias": Llama with `attention_bias` (q/k/v and o) and `mlp_bias` (gate/up/down).

transformers initialises biases to zero: they are filled with random values here so that
they matter.

Weights use a large init range so that attention is peaked and the logits are far apart:
a mistake in rotary frequencies or biases then moves them well beyond float32 noise.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

ARCHITECTURES = ("llama3", "qwen2", "llama_bias")
VOCAB_SIZE = 256
ORIGINAL_CONTEXT = 32
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL_CONTEXT,
}
_SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def word(token_id: int) -> str:
    """The text of a token of the tiny tokenizer (id 0 is `<unk>`)."""
    return f"w{token_id}" if token_id else "<unk>"


def write_tokenizer(path: Path) -> None:
    """A whitespace word-level tokenizer over `w1` .. `w255`; decode joins with spaces."""
    vocab = {word(i): i for i in range(VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def build_hf_model(arch: str, seed: int = 0) -> Any:
    """The reference transformers model of `arch`, seeded, float32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    model: Any
    if arch == "llama3":
        # `rope_scaling` is the spelling both transformers 4 and 5 accept (5 stores it as
        # `rope_parameters`, which is what config.json then holds).
        scaled: dict[str, Any] = {**_SHAPE, "rope_scaling": dict(LLAMA3_ROPE)}
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**scaled, tie_word_embeddings=False)
        )
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**_SHAPE, tie_word_embeddings=True)
        )
    elif arch == "llama_bias":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                **_SHAPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=False
            )
        )
    else:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    with torch.no_grad():
        for bias in biases(model):
            bias.normal_(0.0, 1.0)
    return model.float().eval()


def biases(model: Any) -> list[torch.Tensor]:
    """Every bias of `model`'s layers (none for plain Llama)."""
    return [p for name, p in model.model.layers.named_parameters() if name.endswith(".bias")]


def without_feature(arch: str, model: Any) -> Any:
    """`model` with the path under test switched off: the same weights, but no RoPE scaling
    (llama3) or all biases zero (qwen2, llama_bias). A test whose reference is this model
    must fail."""
    import transformers

    if arch == "llama3":
        plain = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**_SHAPE, tie_word_embeddings=False)
        )
        plain.load_state_dict(model.state_dict())
        return plain.float().eval()
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for bias in biases(plain):
            bias.zero_()
    return plain


def write_tiny_model(arch: str, path: Path, seed: int = 0) -> Any:
    """Save the `arch` model and its tokenizer into `path` (created); returns the HF model."""
    model = build_hf_model(arch, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    write_tokenizer(path)
    return model
