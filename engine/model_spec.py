"""The shape of a Llama-family model, read once from an HF `config.json`.

Lifecycle: `ModelSpec.from_dir(path)` at engine start; the spec then sizes the model's
tensors, the KV pool and the layout fingerprint that peers compare before moving KV. Its
`fingerprint` is the directory's whole identity (`engine.model_identity`: config, weight
bytes, tokenizer, chat template).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.model_identity import ModelIdentity

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling; absent for SmolLM2 and Llama 2."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None
    fingerprint: str
    # The parts `fingerprint` folds (from_dir sets it); `fingerprint` stands for it in
    # comparisons.
    identity: ModelIdentity | None = dataclasses.field(default=None, compare=False)

    def with_weights(self, quantization: str) -> ModelSpec:
        """This spec for weights stored as `quantization` ("none" keeps it as it is): the
        format is folded into the fingerprint, so quantized and full-precision workers
        never share KV or prefix-cache keys (their activations differ)."""
        if quantization == "none":
            return self
        tagged = xxhash.xxh3_64_hexdigest(f"{self.fingerprint}|weights={quantization}".encode())
        return dataclasses.replace(self, fingerprint=tagged)

    @classmethod
    def from_dir(
        cls, model_dir: Path, *, progress: bool = True, hash_weights: bool = True
    ) -> ModelSpec:
        """The spec of an HF-layout directory, its fingerprint the directory's whole
        `ModelIdentity` (the weights hashed once and cached; `progress` shows a bar for a
        large first hash). `hash_weights=False`, for a process that never reads the
        weights, leaves them out: its fingerprint is then not a worker's."""
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{path} not found: --model must be an HF-layout directory")
        identity = ModelIdentity.of_dir(model_dir, progress=progress, hash_weights=hash_weights)
        spec = cls.from_config(json.loads(path.read_text()), identity.fingerprint)
        return dataclasses.replace(spec, identity=identity)

    @classmethod
    def from_config(cls, cfg: dict[str, object], fingerprint: str) -> ModelSpec:
        model_type = str(cfg.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidRequestError(
                "model", f"model_type must be one of {SUPPORTED_MODEL_TYPES}", model_type
            )
        heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        bos = cfg.get("bos_token_id")
        # As in transformers: Qwen2 always has q/k/v biases and nothing else; Llama's
        # `attention_bias` covers q/k/v and o, and `mlp_bias` gate/up/down.
        attention_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
        llama = model_type == "llama"
        return cls(
            model_type=model_type,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),  # type: ignore[call-overload]
            head_dim=int(cfg.get("head_dim") or hidden // heads),  # type: ignore[call-overload]
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=_int(cfg, "max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=llama and attention_bias,
            mlp_bias=llama and bool(cfg.get("mlp_bias", False)),
            bos_token_id=None if bos is None else int(bos),  # type: ignore[call-overload]
            eos_token_ids=tuple(int(e) for e in eos_ids),  # type: ignore[arg-type]
            rope_scaling=_rope_scaling(cfg),
            fingerprint=fingerprint,
        )


def _int(cfg: dict[str, object], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int):
        raise ModelNotFoundError(f"config.json: {key} missing or not an integer")
    return value


def _rope_params(cfg: dict[str, object]) -> dict[str, object]:
    # transformers >= 5 writes `rope_parameters`; older configs use `rope_scaling`.
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if isinstance(value, dict):
            return value
    return {}


def _rope_theta(cfg: dict[str, object]) -> float:
    theta = cfg.get("rope_theta", _rope_params(cfg).get("rope_theta", 10000.0))
    return float(theta)  # type: ignore[arg-type]


def _rope_scaling(cfg: dict[str, object]) -> RopeScaling | None:
    params = _rope_params(cfg)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise InvalidRequestError("model", "rope scaling must be none or llama3", kind)
    return RopeScaling(
        factor=float(params["factor"]),  # type: ignore[arg-type]
        low_freq_factor=float(params["low_freq_factor"]),  # type: ignore[arg-type]
        high_freq_factor=float(params["high_freq_factor"]),  # type: ignore[arg-type]
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),  # type: ignore[call-overload]
    )
