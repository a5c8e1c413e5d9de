"""LoRA adapters in PEFT's format, read onto the engine's fused projections.

Lifecycle: `LoraSet` (engine/lora_set.py) calls `read_adapter(path, target)` when a
request first names an adapter that is not resident; the `LoraAdapter` it returns is
immutable, shared by every request of that adapter, and dropped when the set evicts it
(never while a request holds it). `adapter_digest(path)` (`engine.adapter_ref`) is the
adapter's identity, which gateways compute too: it is folded into the prefix-block
hashes and router keys of the adapter's requests, and a KV hand-off between workers
that disagree on it is refused.

The format is what `peft.PeftModel.save_pretrained` writes: `adapter_config.json` (r,
lora_alpha, target_modules, use_rslora, ...) and `adapter_model.safetensors`, whose keys
look like `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (A is
[r, in], B is [out, r]). The delta of one projection is x @ A.T @ B.T x scale, scale =
alpha / r (alpha / sqrt(r) with rsLoRA), the same as PEFT's.

The engine fuses q/k/v into one `qkv` matmul and gate/up into `gate_up`; an adapter's
q, k and v pieces are stacked the same way: A rows side by side (one [in, sum r] matrix)
and each B on the rows of its own output slice (zeros elsewhere), so one adapter costs
two small matmuls per fused projection. The scale is folded into B, and, when the
linear kernel folds the RMSNorm gains into the weights (int8), the same gains are folded
into A's columns, because the projection then sees the un-scaled normalized input.

What is refused, with a message naming it (`AdapterFormatError`): pickled weights
(`adapter_model.bin`), a peft_type other than LORA, DoRA, trained biases,
`modules_to_save`, `alpha_pattern`, a rank above the engine's `max_lora_rank`, and any
module other than the seven projections of a layer (embeddings, the LM head).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from engine.adapter_ref import (
    WEIGHTS_FILE,
    check_adapter_name,
    digest_start,
    read_config,
    weights_file,
)
from engine.errors import AdapterFormatError
from engine.model_spec import ModelSpec

#: Each PEFT module name -> the engine's fused projection it belongs to.
FUSED = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target, as PEFT's A and B see them."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


@dataclass(frozen=True)
class LoraTarget:
    """What an adapter is read onto: the model's shapes and how its kernel runs."""

    spec: ModelSpec
    dtype: torch.dtype
    device: torch.device
    max_rank: int
    #: The RMSNorm gain each fused projection's input lost to the kernel's folding
    #: (`LlamaModel.folded_gains`): "<layer>.qkv" / "<layer>.gate_up" -> gain; empty when
    #: the kernel does not fold.
    gains: Mapping[str, torch.Tensor]

    def slices(self, module: str) -> tuple[int, int, int]:
        """(start, stop, fused width) of `module`'s output rows in its fused projection
        (the engine fuses in `FUSED`'s order: q, k, v and gate, up)."""
        outs = {m: out for m, (_, out) in module_shapes(self.spec).items()}
        group = [m for m, fused in FUSED.items() if fused == FUSED[module]]
        start = sum(outs[m] for m in group[: group.index(module)])
        return start, start + outs[module], sum(outs[m] for m in group)


@dataclass(frozen=True)
class LoraPair:
    """One fused projection's delta: y += (x @ a_t) @ b_t, a_t [in, rank], b_t [rank, out]
    (the scale already in b_t)."""

    a_t: torch.Tensor
    b_t: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a_t.shape[1])


@dataclass(frozen=True)
class LoraAdapter:
    """A resident adapter: its name, its identity and its deltas by "<layer>.<fused>"."""

    name: str
    digest: str
    rank: int  # the widest fused projection's rank (q + k + v ranks for qkv, ...)
    pairs: Mapping[str, LoraPair]

    @property
    def nbytes(self) -> int:
        return sum(p.a_t.nbytes + p.b_t.nbytes for p in self.pairs.values())


def read_adapter(path: Path, target: LoraTarget, *, name: str = "") -> LoraAdapter:
    """Read the PEFT adapter in `path` onto `target`'s fused projections. The weights
    file is read once: the digest is of the very bytes the tensors come from."""
    name = check_adapter_name(name or path.name)
    config = read_config(path)
    _check_config(path, config)
    blob = weights_file(path).read_bytes()
    digest = digest_start(config)
    digest.update(blob)
    try:
        raw = load_safetensors(blob)
    except Exception as exc:  # safetensors raises its own error types on a bad file
        raise AdapterFormatError(
            f"adapter {path.name!r}: unreadable {WEIGHTS_FILE}: {exc}"
        ) from exc
    pieces = _pieces(path, raw, target)
    alpha = float(str(config.get("lora_alpha", 8)))
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[str, LoraPair] = {}
    for key, modules in sorted(pieces.items()):
        pairs[key] = _fuse(key, modules, target, alpha, rslora)
    rank = max((p.rank for p in pairs.values()), default=0)
    return LoraAdapter(name, digest.hexdigest(), rank, pairs)


def _check_config(path: Path, config: Mapping[str, object]) -> None:
    refusals = [
        (str(config.get("peft_type", "LORA")).upper() != "LORA", "peft_type must be LORA"),
        (bool(config.get("use_dora")), "DoRA (use_dora) is not supported"),
        (config.get("bias", "none") not in ("none", None), "trained biases (bias) are not "
         "supported"),
        (bool(config.get("modules_to_save")), "modules_to_save is not supported"),
        (bool(config.get("alpha_pattern")), "alpha_pattern is not supported"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out is not supported"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise AdapterFormatError(f"adapter {path.name!r}: {why}")


def _pieces(
    path: Path, raw: Mapping[str, torch.Tensor], target: LoraTarget
) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """The tensors by "<layer>.<fused>" -> module -> "A" / "B", checked against the
    model's shapes."""
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterFormatError(
                f"adapter {path.name!r}: tensor {key!r} is not a LoRA A/B of a layer's "
                f"q/k/v/o/gate/up/down projection (the only modules adapters may target)"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= target.spec.num_layers:
            raise AdapterFormatError(
                f"adapter {path.name!r}: {key!r} is for layer {layer}; the model has "
                f"{target.spec.num_layers}"
            )
        slot = out.setdefault(f"{layer}.{FUSED[module]}", {}).setdefault(module, {})
        slot[which] = tensor
    for key, modules in out.items():
        for module, ab in modules.items():
            _check_pair(path, key, module, ab, target)
    return out


def _check_pair(
    path: Path, key: str, module: str, ab: Mapping[str, torch.Tensor], target: LoraTarget
) -> None:
    where = f"adapter {path.name!r}, layer {key.split('.')[0]} {module}"
    if set(ab) != {"A", "B"}:
        raise AdapterFormatError(f"{where}: needs both lora_A and lora_B")
    a, b = ab["A"], ab["B"]
    fan_in, fan_out = module_shapes(target.spec)[module]
    rank = a.shape[0]
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or tuple(b.shape) != (fan_out, rank):
        raise AdapterFormatError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
            f"model (expected [r, {fan_in}] and [{fan_out}, r]): an adapter of another "
            "base model?"
        )
    if rank > target.max_rank:
        raise AdapterFormatError(f"{where}: rank {rank} is above max_lora_rank {target.max_rank}")


def _fuse(
    key: str,
    modules: Mapping[str, Mapping[str, torch.Tensor]],
    target: LoraTarget,
    alpha: float,
    rslora: bool,
) -> LoraPair:
    """Stack one fused projection's modules: A's rows side by side, each B on its slice."""
    a_parts: list[torch.Tensor] = []
    b_cols: list[torch.Tensor] = []
    for module in sorted(modules, key=list(FUSED).index):
        a, b = modules[module]["A"].float(), modules[module]["B"].float()
        rank = a.shape[0]
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        start, stop, width = target.slices(module)
        placed = torch.zeros(width, rank)
        placed[start:stop] = b * scale
        a_parts.append(a)
        b_cols.append(placed)
    a_all = torch.cat(a_parts)  # [sum r, in]
    gain = target.gains.get(key)
    if gain is not None:
        a_all = a_all * gain.float()[None, :]
    b_all = torch.cat(b_cols, dim=1)  # [out, sum r]
    dev, dtype = target.device, target.dtype
    return LoraPair(
        a_all.t().contiguous().to(device=dev, dtype=dtype),
        b_all.t().contiguous().to(device=dev, dtype=dtype),
    )
