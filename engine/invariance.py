"""Batch invariance: whether this engine can give a request the same bits whatever else
runs, and which linear kernel that takes.

Lifecycle: the builder calls `invariant_kernel(config)` once at start, before it picks
the linear kernel; the answer (the kernel to use, and whether invariance is on) is
logged and fixed for the engine's life. Nothing here holds state.

What "covered" means: float32 on the CPU with unquantized weights and `linear_kernel`
auto or tiled. There every projection and the LM head run `engine.weight_tiles`'
float32 tiles (`linear_kernel tiled`), which sum each output of each row in one fixed
order, and every row of every step attends alone through `engine.row_attention`, over
its own positions in position order, whether it is a decode row, a row of a prefill
chunk or a verification row. So a token's bits are a function of the tokens up to it:
not of its batch, of how its prompt was cut into chunks, of whether its prefix came
from the cache or another worker, or of whether its KV was computed by a decode step or
again as a prompt (a migrated or preempted stream). The rest of a float32 step on the
CPU is row-wise (norms, rotary, sampling from per-request random streams). Tests hold
the result, not the argument: a request's log-probabilities are the same floats alone
and batched, cut differently, from a cache hit and recomputed
(`tests/unit/engine/test_batch_invariance.py`, `tests/integration/test_determinism.py`).

The gap left inside a covered engine: an 8-bit KV cache (its rows keep torch's
attention, whose order follows the call's shape) and rows with a LoRA adapter (their
low-rank product is torch's), neither measured.

Not covered, so `auto` is off there and `on` refuses to start: bfloat16 (the fused
decode step and the torch step round differently, and the torch path's bf16 products
are oneDNN's), float16, GPUs, int8 weights (their outlier product is a float sum over
a batch-dependent column set). What it never covers: another host, dtype, model
or engine version (docs/engine.md "Batch invariance").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import BatchInvariance, EngineConfig, LinearKernelName
from engine.precision import WeightQuant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InvariantChoice:
    """What `invariant_kernel` decided: the linear kernel to pick, and whether the
    engine is batch-invariant."""

    linear_kernel: LinearKernelName
    invariant: bool


#: An engine's choice with invariance off and every kernel left to `auto`.
NOT_INVARIANT = InvariantChoice(LinearKernelName.AUTO, invariant=False)


def uncovered_reason(
    kernel: LinearKernelName, device: torch.device, dtype: torch.dtype, quant: WeightQuant
) -> str | None:
    """Why this engine has no batch-invariant kernels, or None if it has them."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"invariant kernels exist for float32 on the CPU only (got {dtype} on {device})"
    if quant is not WeightQuant.NONE:
        return f"quantization {quant.value} has no invariant kernel"
    if kernel not in (LinearKernelName.AUTO, LinearKernelName.TILED):
        return f"linear_kernel {kernel.value} sums rows in a batch-dependent order"
    return None


def invariant_kernel(config: EngineConfig) -> InvariantChoice:
    """The linear kernel `config` gets, and whether the engine is batch-invariant;
    ValueError naming the reason when `batch_invariant on` cannot be had."""
    choice, kernel = config.batch_invariant, config.linear_kernel
    if choice is BatchInvariance.OFF:
        return InvariantChoice(kernel, kernel is LinearKernelName.TILED)
    device, dtype = config.torch_device, config.torch_dtype
    reason = uncovered_reason(kernel, device, dtype, config.quantization)
    if reason is None:
        log.info("batch_invariant %s: on (linear kernel tiled)", choice.value)
        return InvariantChoice(LinearKernelName.TILED, True)
    if choice is BatchInvariance.ON:
        raise ValueError(f"batch_invariant on: {reason}; pass batch_invariant off or auto")
    log.info("batch_invariant auto: off (%s)", reason)
    return InvariantChoice(kernel, False)
