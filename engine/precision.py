"""Number formats of one engine: the compute dtype and the weights' quantization.

Lifecycle: `EngineConfig` holds a `DType` and a `WeightQuant` as chosen by flags (`auto`
and `none` by default); at engine start `resolve_dtype` turns `auto` into a torch dtype
for the device, once, and logs why; `LlamaModel` computes in that dtype and hands its
projections to the linear kernel `pick_linear_kernel` chose for the pair.

Why bf16 by default where the CPU computes it natively: there a bf16 product moves half
the bytes of an fp32 one and runs on the CPU's bf16 dot products, so the model's GEMMs
and the engine's prefill run faster with nothing else changed (measurements:
docs/engine.md "Precision"). A CPU without native bf16 converts every element through
fp32 and gains nothing, so `auto` stays fp32 there. The accuracy gate in the test suite
holds every non-fp32 mode to the fp32 engine; fp32 keeps token-exact parity with HF
transformers.
"""

from __future__ import annotations

import enum
import functools
import logging
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: /proc/cpuinfo flags of a CPU with bf16 dot products in hardware (x86 AVX-512 BF16 or
#: AMX; Arm's BF16 extension).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


class DType(enum.StrEnum):
    """The dtype activations, weights (unless quantized) and the KV cache compute in."""

    AUTO = "auto"  # bf16 on CUDA and on CPUs with native bf16; fp32 elsewhere
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class WeightQuant(enum.StrEnum):
    """How the projection weights are stored and multiplied."""

    NONE = "none"  # in the compute dtype
    INT8 = "int8"  # per-channel int8 weights, per-token int8 activations bar outlier columns (CPU)


class KvCacheDType(enum.StrEnum):
    """How the KV cache stores keys and values (`docs/engine.md` "KV cache")."""

    AUTO = "auto"  # the compute dtype
    INT8 = "int8"  # int8 with a float32 scale per block, layer, K/V and KV head
    FP8_E4M3 = "fp8_e4m3"  # torch.float8_e4m3fn with the same scales


def kv_storage_dtype(kv: KvCacheDType, compute: torch.dtype) -> torch.dtype:
    """The torch dtype the KV pool stores for `kv` when the model computes in `compute`."""
    import torch  # here, not at import: services that never compute read the enums above

    if kv is KvCacheDType.INT8:
        return torch.int8
    if kv is KvCacheDType.FP8_E4M3:
        return torch.float8_e4m3fn
    return compute


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty where it does not)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    return bool(cpu_flags() & _BF16_FLAGS)


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    """The torch dtype `dtype` means on `device`; `auto` is decided here and logged."""
    import torch

    if dtype is not DType.AUTO:
        resolved: torch.dtype = getattr(torch, dtype.value)
        return resolved
    if device.type == "cuda":
        return torch.bfloat16
    if cpu_has_native_bf16():
        log.info("dtype auto: bfloat16 (this CPU computes bf16 natively)")
        return torch.bfloat16
    log.info("dtype auto: float32 (no native bf16 on this %s CPU)", platform.machine())
    return torch.float32


def check_quant(quant: WeightQuant, device: torch.device) -> None:
    """Refuse a quantization this device has no kernel for, naming the flag."""
    if quant is WeightQuant.INT8 and device.type != "cpu":
        raise ValueError(f"quantization int8 runs on the CPU only; got device {device.type}")
