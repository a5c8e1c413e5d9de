"""How the model's linear layers multiply: plain torch, oneDNN with pre-packed weights,
float32 tiles whose rows do not depend on their batch, or int8 weights through
`torch._int_mm`.

Lifecycle: the engine picks a kernel once (`pick_linear_kernel(name, device, dtype,
quant)`);
`LlamaModel` hands every projection weight to `prepare` as it loads them and keeps the
`LinearWeight` it gets back, then calls `apply(x, weight, bias)` for each projection of
each step. A `LinearWeight` is only ever handed back to the kernel that prepared it.

Why pack on CPU: a decode step multiplies a handful of rows (one per running request) by
every weight of the model, and MKL's sgemm behind `F.linear` is slow at such small row
counts. oneDNN, with the weights reordered once into its blocked layout, is faster at a
few rows to a few dozen, level with `F.linear` beyond, and a little slower at the row
counts of prefill chunks; so in float32 the packed copy serves steps of up to
`ONEDNN_MAX_ROWS` rows and the plain weight the rest. The LM head, the largest
product, gains most. The price is memory: a second copy of the projection and LM-head
weights in float32; `linear_kernel torch` keeps one. Results differ from `F.linear` in
the last bits of float32 (another summation order), as any change of batch shape
already makes them.

In bfloat16 (on a CPU with native bf16: `engine.precision`) the packed copy is used for
every row count, and no plain copy is kept: it is faster than `F.linear` at decode row
counts and level with it at prefill's (`F.linear` in bf16 goes to oneDNN too, but
reorders the weight on every call). oneDNN packs bf16 only where the CPU has AVX-512
(BW, VL, DQ) or AVX-NE-CONVERT; elsewhere its reorder raises, so "auto" takes the torch
kernel for bf16 and "onednn" is refused (`onednn_packs_bf16`).

Measurements (by row count, the LM head, the memory): docs/engine.md "Kernels".

Tiled (`linear_kernel tiled`, float32 on CPU): the weights packed once into
`engine.weight_tiles`'s float32 tiles and multiplied by its compiled loop, which sums
each output of each row in input order in one accumulator. A row's result is then the
same bits whatever else shares the step and however many rows it has (MKL and oneDNN
choose their blocking, and so their order of summation, by the row count: the
invariance probe, docs/engine.md "Batch invariance"). Large products are split over
threads by tiles of output columns, which changes no sum. The cost against oneDNN by
row count: docs/engine.md "Batch invariance".

Int8 (`quantization int8`): each weight is quantized once at load, per output channel
and symmetric; each step's activations are quantized per token on the fly, and the
product runs in int8 through `torch._int_mm` (oneDNN's s8s8 GEMM with VNNI dot
products, accumulating in int32). Per token, not per tensor: fbgemm's dynamic linear
(one scale for the whole batch) fails the accuracy gate on SmolLM2, because the MLP's
down projection sees activation outliers that flatten every other row to a few levels.
Per token is not enough on its own either: a few channels of the normalized hidden
state are an order of magnitude above the rest on every token, and those set each
row's scale. So the activations
past `OUTLIER_THRESHOLD` are taken out of the int8 product and multiplied in float
against their dequantized weight rows (LLM.int8()'s decomposition, Dettmers et al.
2022). The full-precision weights are dropped once quantized (the tied embedding stays,
for lookups).
"""

from __future__ import annotations

import functools
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import LinearKernelName
from engine.precision import WeightQuant, cpu_has_native_bf16
from engine.range_split import run_ranges

ONEDNN_MAX_ROWS = 48  # in fp32, past this many rows MKL's sgemm is as fast (see above)
#: Rows from which a widened bf16 product (`TorchLinear(widen=True)`) converts to float32.
#: Without native bf16, `F.linear` in bf16 ran at about 10 GFLOPS at every row count on
#: a 2-core AMD EPYC (AVX2), sgemm at 57-91 from 16 rows; converting the weight costs
#: about what 13 bf16 rows of the LM head do (77 ms against 6 a row), and less for the
#: layers' projections, so from 16 rows widening wins on every weight of the model.
WIDEN_MIN_ROWS = 16
#: Symmetric int8 range of a weight channel.
INT8_MAX = 127
#: An activation whose magnitude passes this is multiplied in float, not int8. LLM.int8()
#: uses 6 on raw activations; here the projections' inputs are normalized, with their
#: RMSNorm gains folded into the weights, so their outliers stand above a much lower
#: floor. Chosen on SmolLM2's projections over the accuracy gate's text, where 4 gave
#: the best teacher-forced agreement in both dtypes (the activations' peaks and the
#: thresholds tried: docs/engine.md "Precision").
OUTLIER_THRESHOLD = 4.0
#: Multiply-adds below which a tiled product runs on the calling thread alone: handing
#: a range to another thread costs tens of microseconds, about what this much work takes.
TILED_SPLIT_WORK = 1 << 21


@dataclass(frozen=True)
class LinearWeight:
    """A projection weight as loaded ([out, in]) and/or the kernel's packed copy.

    `plain` is None only for the int8 kernel, which keeps nothing but its packed form.
    """

    plain: torch.Tensor | None
    packed: Any = None  # a oneDNN tensor, or int8's (weight [in, out], channel scales)


class LinearKernel(Protocol):
    """Multiplies activations by projection weights. `prepare` runs once per weight at
    load; `apply` takes a 2-D `x` of the model's dtype on the weight's device and only
    weights this same kernel prepared. Prepared weights are read-only afterwards, so
    steps may run from any thread."""

    name: str
    #: Whether the model should fold each RMSNorm's weight into the projections it feeds
    #: (exact in real arithmetic; see `Int8Linear`).
    folds_norms: bool

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        """Wrap `weight` ([out, in]) with whatever this kernel multiplies fastest."""
        ...

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) for a weight this kernel prepared; x is [rows, in]."""
        ...


class TorchLinear:
    """`F.linear` on the weights as loaded: every device, every dtype.

    `widen` (bf16 on a CPU without native bf16, `pick_linear_kernel`): a product of at
    least `WIDEN_MIN_ROWS` rows converts its operands to float32, multiplies through
    MKL's sgemm and rounds the result back to bf16, which is what a bf16 GEMM computes
    (float32 accumulation, one rounding) in another summation order. The weight stays
    bf16 in memory."""

    name = "torch"
    folds_norms = False

    def __init__(self, widen: bool = False) -> None:
        self.widen = widen

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        return LinearWeight(weight)

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert weight.plain is not None, "a weight another kernel prepared"
        if self.widen and x.shape[0] >= WIDEN_MIN_ROWS:
            wide_bias = None if bias is None else bias.float()
            return F.linear(x.float(), weight.plain.float(), wide_bias).to(x.dtype)
        return F.linear(x, weight.plain, bias)


class OneDnnLinear:
    """Steps of up to `max_rows` rows through oneDNN on a pre-packed copy, larger ones
    through `F.linear` (CPU; float32 or bfloat16)."""

    name = "onednn"
    folds_norms = False

    def __init__(self, max_rows: int | None = ONEDNN_MAX_ROWS) -> None:
        self.max_rows = max_rows  # None: always packed

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        # The batch-size hint only picks the blocked layout; any row count works after.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
        # Always packed: the plain copy would never be read, so it is not kept.
        return LinearWeight(weight if self.max_rows is not None else None, packed)

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        too_big = self.max_rows is not None and x.shape[0] > self.max_rows
        if weight.packed is None or too_big:
            assert weight.plain is not None
            return F.linear(x, weight.plain, bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, weight.packed, bias, "none", [], ""
        )
        return out


class TiledLinear:
    """float32 products through `engine.weight_tiles`' tiles (CPU): every row summed in
    input order alone, so its bits do not depend on the other rows of its step. Large
    products are split by tiles over `threads` threads (the caller's and a pool's)."""

    name = "tiled"
    folds_norms = False

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(threads, 1)
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        from engine.weight_tiles import pack_f32

        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                "linear_kernel tiled multiplies float32 weights on the CPU, got "
                f"{weight.dtype} on {weight.device.type}"
            )
        tiles = pack_f32(weight.detach().contiguous().numpy())
        return LinearWeight(None, (tiles, weight.shape[0]))

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        from engine.weight_tiles import matmul_f32

        tiles, n_out = weight.packed
        rows = x.shape[0]
        out = np.empty((rows, n_out), dtype=np.float32)
        xb = x.detach().contiguous().numpy().view(np.uint16)
        n_tiles = tiles.shape[0]
        work = rows * n_out * x.shape[1]
        parts = min(self.threads, n_tiles, max(work // TILED_SPLIT_WORK, 1))
        if rows:
            per = -(-n_tiles // parts)
            ranges = [(t, min(t + per, n_tiles)) for t in range(0, n_tiles, per)]
            run_ranges(self._pool, functools.partial(matmul_f32, tiles, xb, out), ranges)
        result = torch.from_numpy(out)
        if bias is not None:
            result += bias
        return result


class Int8Linear:
    """Per-channel int8 weights and per-token dynamic int8 activations (CPU).

    Each step's activations are quantized per row (symmetric, scale = the row's largest
    magnitude / 127), multiplied in int8 with int32 accumulation by `torch._int_mm`
    (oneDNN's s8s8 GEMM, VNNI dot products where the CPU has them), and scaled back by
    the row's and the output channel's scales.

    It asks the model to fold the RMSNorm weights into the projections after them: the
    norms' per-channel gains are where SmolLM2's activation outliers come from, and one
    outlier channel flattens a whole token's int8 row. Folded, the quantized activations
    are the plain normalized ones and the gains ride on the weights, per input column,
    where per-channel weight scales absorb them (the accuracy gate's perplexity is
    lower folded).

    The outliers left after folding (a few channels of the normalized residual stream,
    20-24 on every token) are split off: activations past `OUTLIER_THRESHOLD` are zeroed
    in the int8 product and added back as a float product with their dequantized weight
    rows, so each row's scale is set by its ordinary channels. Per activation, not per
    column as LLM.int8() splits: a row's result then depends on that row alone, not on
    what else shares its batch. The split costs a few small ops per call (a mask, a
    `nonzero` and a small float product). Its accuracy and its cost: docs/engine.md
    "Precision".
    """

    name = "int8"
    folds_norms = True

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).to(torch.int8)
        # [in, out] as a transposed view of the [out, in] rows: oneDNN's fast layout for
        # one-row products (faster than the contiguous [in, out] there).
        return LinearWeight(None, (q.t(), scale))

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        qweight, wscale = weight.packed
        if x.shape[0] == 0:
            return x.new_zeros(0, qweight.shape[1])
        xf = x.float()
        magnitude = xf.abs()
        outlier = magnitude > OUTLIER_THRESHOLD
        columns = outlier.any(dim=0).nonzero().flatten()
        split = columns.numel() > 0
        if split:
            magnitude.masked_fill_(outlier, 0.0)
        xscale = (magnitude.amax(dim=1, keepdim=True) / INT8_MAX).clamp_(min=1e-12)
        # The clamp only bites on outliers, which are zeroed next.
        qx = torch.round(xf / xscale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        if split:
            qx.masked_fill_(outlier, 0)
        out = torch._int_mm(qx, qweight).float().mul_(xscale).mul_(wscale)
        if split:
            # Only the columns holding an outlier somewhere; in each, only the outliers.
            big = xf[:, columns] * outlier[:, columns]
            out.addmm_(big, qweight[columns].float().mul_(wscale))
        if bias is not None:
            out += bias
        return out.to(x.dtype)


@functools.cache
def onednn_packs_bf16() -> bool:
    """Whether oneDNN can pack and multiply bf16 weights on this CPU. Without AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT its weight reorder refuses bf16 outright, so "auto"
    takes the torch kernel for bf16 there (widened where the CPU has no native bf16)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pick_linear_kernel(
    choice: LinearKernelName | str,
    device: torch.device,
    dtype: torch.dtype,
    quant: WeightQuant = WeightQuant.NONE,
) -> LinearKernel:
    """The kernel `choice` names; "auto" takes oneDNN on x86 CPUs in float32, and in
    bfloat16 where oneDNN packs bf16 (`onednn_packs_bf16`), torch elsewhere. Int8
    weights have one kernel, which only "auto" picks. "tiled" needs float32 on the CPU
    and splits large products over torch's thread count."""
    try:
        name = LinearKernelName(choice)
    except ValueError:
        names = ", ".join(k.value for k in LinearKernelName)
        raise ValueError(f"linear_kernel must be one of {names}, got {choice!r}") from None
    if quant is WeightQuant.INT8:
        if name is not LinearKernelName.AUTO:
            raise ValueError(
                f"quantization int8 has its own kernel; linear_kernel {name.value} is not it"
            )
        return Int8Linear()
    onednn_ok = (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and (dtype != torch.bfloat16 or onednn_packs_bf16())
    )
    if name is LinearKernelName.TILED:
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                "linear_kernel tiled needs device cpu and dtype float32 "
                f"(got device {device.type}, dtype {dtype})"
            )
        return TiledLinear(torch.get_num_threads())
    if name is LinearKernelName.ONEDNN and not onednn_ok:
        raise ValueError(
            "linear_kernel onednn needs device cpu, dtype float32 or bfloat16 (bfloat16 only "
            "on a CPU whose oneDNN packs bf16 weights: AVX-512 BW/VL/DQ or AVX-NE-CONVERT) "
            f"and a torch built with oneDNN (got device {device.type}, dtype {dtype})"
        )
    # "auto" packs only on x86, where the gain was measured.
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    auto_torch = name is LinearKernelName.AUTO and not (onednn_ok and x86)
    if name is LinearKernelName.TORCH or auto_torch:
        widen = device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16()
        return TorchLinear(widen=widen)
    return OneDnnLinear(ONEDNN_MAX_ROWS if dtype == torch.float32 else None)
