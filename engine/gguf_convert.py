"""Convert a llama-architecture GGUF file into a Hugging Face model directory.

Lifecycle of one conversion:

1. Open the GGUF with `gguf.GGUFReader` (memory-mapped) and read the hyperparameters
   and tokenizer metadata into a frozen `LlamaHParams`.
2. Dequantize every tensor to float32, rename it from llama.cpp's scheme to HF Llama's
   (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...) and undo the
   row permutation llama.cpp's converter applied to q_proj and k_proj.
3. Build the byte-level BPE tokenizer (`tokenizer.json`) from the GGUF vocabulary and
   merges, with every CONTROL token registered as a special added token.
4. Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
   generation_config.json into a temporary sibling of `out_dir`, then rename it into
   place. A crash at any point leaves either no `out_dir` or a complete one, never a
   half-written model; the temporary directory is removed on failure.

The output is float32 (dequantized Q4_1/Q8_0 weights are exact in float32), and the
output head is tied to the embeddings, so no `lm_head.weight` is written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from engine.errors import InvalidRequestError

# llama.cpp's gguf token_type enum: only CONTROL tokens become special added tokens.
_TOKEN_TYPE_CONTROL = 3

# GGUF per-layer tensor suffix -> HF Llama per-layer module path.
_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    # Written only by GGUFs with untied heads; ours is tied and has none.
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


@dataclass(frozen=True)
class LlamaHParams:
    """The hyperparameters and special-token ids a Llama GGUF declares."""

    n_layer: int
    hidden_size: int
    intermediate_size: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    unk_token_id: int
    pad_token_id: int
    add_bos_token: bool

    def __post_init__(self) -> None:
        if self.n_head <= 0 or self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise InvalidRequestError(
                "gguf", "head_count must be a positive multiple of head_count_kv", self.n_head
            )
        if self.head_dim % 2:
            raise InvalidRequestError("gguf", "head_dim must be even for RoPE", self.head_dim)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata `key`, or `default` when it is absent."""
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise InvalidRequestError("gguf", f"metadata key {key} is required", None)
        return default
    return field.contents()


def _f32(value: float) -> float:
    """A GGUF float32 as the shortest decimal that round-trips (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def read_hparams(reader: GGUFReader) -> LlamaHParams:
    """Read the Llama hyperparameters; raises InvalidRequestError for another architecture."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise InvalidRequestError("gguf", "general.architecture must be llama", arch)
    hidden = int(_field(reader, "llama.embedding_length"))
    n_head = int(_field(reader, "llama.attention.head_count"))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else 0
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    return LlamaHParams(
        n_layer=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        n_head=n_head,
        n_head_kv=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // n_head)),
        rope_theta=_f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(_field(reader, "llama.context_length", 2048)),
        vocab_size=int(_field(reader, "llama.vocab_size", n_tokens)),
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=eos,
        unk_token_id=int(_field(reader, "tokenizer.ggml.unknown_token_id", eos)),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", eos)),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF Llama name of a GGUF tensor, or None for tensors HF does not keep."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        # e.g. rope_freqs.weight: HF recomputes it from rope_theta.
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, restoring HF's rotate-half row order.

    llama.cpp's converter maps, within each head of `head_dim` rows, HF row
    `j * head_dim/2 + i` to GGUF row `2 * i + j` (i < head_dim/2, j in {0, 1}) so that
    RoPE rotates adjacent pairs. Reading GGUF rows as (head, i, j) and swapping the
    last two axes gives back (head, j, i), the HF order.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise InvalidRequestError("gguf", f"q/k rows must split into {n_head} even heads", rows)
    half = rows // n_head // 2
    return np.ascontiguousarray(
        weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as a C-contiguous float32 array in HF's (out_features, in_features) order."""
    array = dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(array, dtype=np.float32)


def iter_hf_tensors(
    reader: GGUFReader, hparams: LlamaHParams, *, progress: bool
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array) for every tensor HF keeps, un-permuting q and k."""
    for tensor in tqdm(reader.tensors, desc="gguf->hf", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = _dequantized(tensor)
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_qk(array, hparams.n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_qk(array, hparams.n_head_kv)
        yield name, array


def _check_tensors(tensors: dict[str, np.ndarray], hparams: LlamaHParams) -> None:
    """Refuse a GGUF whose tensors do not cover every layer (a truncated or odd file)."""
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(hparams.n_layer):
        expected |= {f"model.layers.{layer}.{m}.weight" for m in _LAYER_NAMES.values()}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise InvalidRequestError("gguf", "tensors missing from the file", missing[:4])


def config_json(hparams: LlamaHParams, tied: bool) -> dict[str, Any]:
    """A transformers LlamaConfig dictionary for `hparams`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hparams.hidden_size,
        "intermediate_size": hparams.intermediate_size,
        "num_hidden_layers": hparams.n_layer,
        "num_attention_heads": hparams.n_head,
        "num_key_value_heads": hparams.n_head_kv,
        "head_dim": hparams.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hparams.rms_norm_eps,
        "rope_theta": hparams.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": hparams.context_length,
        "vocab_size": hparams.vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": hparams.bos_token_id,
        "eos_token_id": hparams.eos_token_id,
        "pad_token_id": hparams.pad_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def generation_config_json(hparams: LlamaHParams) -> dict[str, Any]:
    """Default generation settings: stop at EOS, pad with the pad id."""
    return {
        "bos_token_id": hparams.bos_token_id,
        "eos_token_id": hparams.eos_token_id,
        "pad_token_id": hparams.pad_token_id,
    }


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """The byte-level BPE tokenizer a 'gpt2'-model GGUF describes."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise InvalidRequestError("gguf", "tokenizer.ggml.model must be gpt2 (byte BPE)", model)
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InvalidRequestError("gguf", "tokenizer.ggml.tokens must be unique", len(tokens))
    # A merge is "left right". Byte-level symbols never hold a raw space; like llama.cpp
    # we still split at the first space after index 0 so a left side of " " survives.
    merges: list[tuple[str, str]] = []
    for merge in _field(reader, "tokenizer.ggml.merges"):
        cut = merge.index(" ", 1)
        merges.append((merge[:cut], merge[cut + 1 :]))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tok for tok, kind in zip(tokens, types, strict=True) if kind == _TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in specials]
    )
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """HF's pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` names we support."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 regex runs.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt-2", "default"):
        return byte_level
    raise InvalidRequestError("gguf", "tokenizer.ggml.pre must be smollm or gpt-2", pre)


def tokenizer_config_json(reader: GGUFReader, hparams: LlamaHParams) -> dict[str, Any]:
    """tokenizer_config.json: special-token strings, BOS policy and the chat template."""
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[hparams.bos_token_id],
        "eos_token": tokens[hparams.eos_token_id],
        "unk_token": tokens[hparams.unk_token_id],
        "pad_token": tokens[hparams.pad_token_id],
        "add_bos_token": hparams.add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hparams.context_length,
    }
    template = reader.get_field("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template.contents()
    return config


def _fsync_file(path: Path) -> None:
    """Flush `path` to disk so the later rename never exposes an empty file after a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    _fsync_file(path)


def _write_model(reader: GGUFReader, out: Path, *, progress: bool) -> None:
    """Write every file of the HF directory into `out` (an existing, empty directory)."""
    hparams = read_hparams(reader)
    tensors = dict(iter_hf_tensors(reader, hparams, progress=progress))
    _check_tensors(tensors, hparams)
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600
    _fsync_file(out / "model.safetensors")
    del tensors
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    _fsync_file(out / "tokenizer.json")
    _write_json(out / "config.json", config_json(hparams, tied))
    _write_json(out / "tokenizer_config.json", tokenizer_config_json(reader, hparams))
    _write_json(out / "generation_config.json", generation_config_json(hparams))


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert `gguf_path` into an HF Llama directory at `out_dir` and return `out_dir`.

    Preconditions: `out_dir` does not exist (or is an empty directory); its parent is
    created if missing. Side effects: writes a temporary sibling `.<name>.tmp-*` that is
    renamed to `out_dir` when complete, or removed on any failure. Raises
    FileExistsError if `out_dir` already holds files (it is never overwritten) and
    InvalidRequestError for a GGUF that is not a llama model with a gpt2 tokenizer.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_model(GGUFReader(Path(gguf_path)), tmp, progress=progress)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a model dir is meant to be shared
        try:
            os.rename(tmp, out_dir)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            raise FileExistsError(f"{out_dir} already exists and is not empty") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
