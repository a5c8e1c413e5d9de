"""The Llama-family transformer (Llama, SmolLM2, Qwen2) over a paged KV cache.

Lifecycle: `LlamaModel(spec, dtype, device, kernel, fused_kv=...)` builds empty weights;
`load_weights(model_dir)` fills them from HF safetensors (fusing q/k/v and gate/up into
single matmuls, then handing each projection to the linear kernel to prepare, and, when
asked, building the fused decode's own copy in `fused`); then each engine step calls
`forward` on a flat batch of tokens, which writes the new K/V into the cache and returns
hidden states, and `logits` on the rows that sample (or, for a step of decodes only,
up to `fused_decode.MAX_ROWS` rows of them, `fused.decode` instead:
`engine/fused_decode.py`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from engine.attention import AttentionBackend, AttentionMetadata
from engine.errors import ModelNotFoundError
from engine.fused_decode import FusedDecoder
from engine.kv_cache import KvCache, KvWrite
from engine.linear_kernel import LinearKernel, LinearWeight, TorchLinear
from engine.lora_batch import LoraBatch
from engine.model_spec import ModelSpec, RopeScaling

log = logging.getLogger(__name__)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 scaling when the config asks for it."""
    dim = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_scaling is not None:
        inv = _llama3_scale(inv, spec.rope_scaling)
    return inv


def rope_angles(spec: ModelSpec) -> torch.Tensor:
    """float32 [max_position_embeddings, head_dim]: each position's rotary angles, the
    frequencies repeated for both halves of a head (HF's layout)."""
    pos = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(pos, rope_inv_freq(spec))
    return torch.cat((freqs, freqs), dim=-1)


def _llama3_scale(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF's LlamaRMSNorm, so fp32 results match bit for bit.
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights plus the forward pass; holds no per-request state."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        kernel: LinearKernel | None = None,
        *,
        fused_kv: torch.dtype | None = None,
    ) -> None:
        """`fused_kv`: also build the fused decode at load, for a KV cache that stores
        this dtype (bfloat16 on CPU; the engine decides, `fused_decode_wanted`); None:
        none."""
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.kernel = kernel or TorchLinear()
        self.weights: dict[str, torch.Tensor] = {}  # embeddings, norms, biases
        self.linears: dict[str, LinearWeight] = {}  # the layers' projections, prepared
        # The RMSNorm gains folded into each projection after them (int8): LoRA's A
        # matrices get the same gains (`engine/lora.py`). Empty when nothing is folded.
        self.folded_gains: dict[str, torch.Tensor] = {}
        self._fused_kv = fused_kv
        self.fused: FusedDecoder | None = None  # built by load_weights when wanted
        angles = rope_angles(spec)
        self._cos = angles.cos().to(device=device, dtype=dtype)
        self._sin = angles.sin().to(device=device, dtype=dtype)

    # -- weights -----------------------------------------------------------------
    def load_weights(self, model_dir: Path, *, progress: bool = False) -> None:
        """Fill the weights from `model_dir`; `progress` shows a bar while the kernel
        prepares (packs or quantizes) the projections, the slow part of loading."""
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors in {model_dir}")
        raw: dict[str, torch.Tensor] = {}
        for path in files:
            raw.update(load_file(str(path)))
        weights = self._arrange(raw)
        projections = self._projections(raw, weights["embed"])
        if self.kernel.folds_norms:
            self._fold_norms(weights, projections)
        bar = tqdm(
            projections.items(),
            desc=f"weights ({self.kernel.name})",
            unit="tensor",
            disable=None if progress else True,  # None: tqdm shows it on a terminal only
        )
        linears = {name: self.kernel.prepare(w) for name, w in bar}
        fused = (
            self._fused_decoder(projections, weights, self._fused_kv) if self._fused_kv else None
        )
        self.weights, self.linears = weights, linears  # both or neither, if loading fails
        self.fused = fused

    def _fused_decoder(
        self,
        projections: dict[str, torch.Tensor],
        weights: dict[str, torch.Tensor],
        kv_dtype: torch.dtype,
    ) -> FusedDecoder | None:
        """The fused decode over these weights, or None (logged) if numba cannot compile
        or load its kernel: every step then runs through torch, only slower."""
        s = self.spec
        angles = rope_angles(s)  # float32: the kernel rotates in float32
        try:
            return FusedDecoder(
                projections,
                weights,
                (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim),
                (angles.cos(), angles.sin()),
                s.rms_norm_eps,
                kv_dtype,
            )
        except Exception as exc:  # e.g. no writable cache directory for numba's kernels
            log.warning("fused decode off, decode steps run through torch: %s", exc)
            return None

    def _arrange(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        take = self._taker(raw)
        w: dict[str, torch.Tensor] = {"embed": take("model.embed_tokens.weight")}
        s = self.spec
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            if s.qkv_bias:
                w[f"{i}.qkv_b"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            if s.o_bias:
                w[f"{i}.o_b"] = take(p + "self_attn.o_proj.bias")
            if s.mlp_bias:
                w[f"{i}.gate_up_b"] = torch.cat(
                    [take(p + f"mlp.{x}_proj.bias") for x in ("gate", "up")]
                )
                w[f"{i}.down_b"] = take(p + "mlp.down_proj.bias")
            w[f"{i}.in_norm"] = take(p + "input_layernorm.weight")
            w[f"{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
        w["norm"] = take("model.norm.weight")
        return w

    def _projections(
        self, raw: dict[str, torch.Tensor], embed: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Each layer's projections (q/k/v and gate/up fused into one matmul each) and the
        LM head (`embed` itself when tied: one tensor, not a copy)."""
        take = self._taker(raw)
        out: dict[str, torch.Tensor] = {}
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            out[f"{i}.qkv"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"])
            out[f"{i}.o"] = take(a + "o_proj.weight")
            out[f"{i}.gate_up"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            )
            out[f"{i}.down"] = take(p + "mlp.down_proj.weight")
        tied = self.spec.tie_word_embeddings or "lm_head.weight" not in raw
        out["lm_head"] = embed if tied else take("lm_head.weight")
        return out

    def _fold_norms(
        self, weights: dict[str, torch.Tensor], projections: dict[str, torch.Tensor]
    ) -> None:
        """Move each RMSNorm's weight into the projections it feeds (W[:, j] * g[j]) and
        make the norm's own weight ones: (x * g) @ W.T == x @ (W * g).T. The LM head is a
        new tensor then, never the tied embedding scaled in place."""
        pairs = [(f"{i}.in_norm", f"{i}.qkv") for i in range(self.spec.num_layers)]
        pairs += [(f"{i}.post_norm", f"{i}.gate_up") for i in range(self.spec.num_layers)]
        pairs.append(("norm", "lm_head"))
        for norm, proj in pairs:
            gain = weights[norm]
            self.folded_gains[proj] = gain
            projections[proj] = projections[proj] * gain[None, :]
            weights[norm] = torch.ones_like(gain)

    def _taker(self, raw: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
        def take(name: str) -> torch.Tensor:
            if name not in raw:
                raise ModelNotFoundError(f"weight {name} missing from the safetensors files")
            return raw[name].to(device=self.device, dtype=self.dtype)

        return take

    # -- forward -----------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Run the flat batch; writes K/V by `meta.kv_write`; returns [T, hidden].
        `lora` adds each row's adapter to the layers' projections (None: base model)."""
        w = self.weights
        x = F.embedding(input_ids, w["embed"])
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        for i in range(self.spec.num_layers):
            h = _rms_norm(x, w[f"{i}.in_norm"], self.spec.rms_norm_eps)
            x = x + self._attention(i, h, cos, sin, kv_cache, meta, backend, lora)
            h = _rms_norm(x, w[f"{i}.post_norm"], self.spec.rms_norm_eps)
            x = x + self._mlp(i, h, lora)
        return _rms_norm(x, w["norm"], self.spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(hidden, self.linears["lm_head"]).float()

    def _attention(
        self,
        i: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        s = self.spec
        t = h.shape[0]
        qkv = self._project(f"{i}.qkv", h, lora)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        # Rotate q and k as one tensor of heads + kv_heads: half the small ops per layer.
        qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
        qk = qk.reshape(t, s.num_heads + s.num_kv_heads, s.head_dim)
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
        assert isinstance(meta.kv_write, KvWrite), "ModelRunner plans the step's KV writes"
        kv_cache.write(i, k, v.view(t, s.num_kv_heads, s.head_dim), meta.kv_write)
        out = backend.attend(q, kv_cache.layer(i), meta)
        return self._project(f"{i}.o", out.reshape(t, q_size), lora)

    def _mlp(self, i: int, h: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        gate, up = self._project(f"{i}.gate_up", h, lora).chunk(2, dim=-1)
        return self._project(f"{i}.down", F.silu(gate) * up, lora)

    def _project(self, key: str, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """Projection `key` ("<layer>.qkv" ...) of x, with its bias and the rows' LoRA."""
        y = self.kernel.apply(x, self.linears[key], self.weights.get(f"{key}_b"))
        if lora is not None:
            lora.add(key, x, y)
        return y
