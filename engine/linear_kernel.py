"""How the model's linear layers multiply: plain torch, or oneDNN with pre-packed weights.

Lifecycle: the engine picks a kernel once (`pick_linear_kernel(name, device, dtype)`);
`LlamaModel` hands every projection weight to `prepare` as it loads them and keeps the
`LinearWeight` it gets back, then calls `apply(x, weight, bias)` for each projection of
each step. A `LinearWeight` is only ever handed back to the kernel that prepared it.

Why pack on CPU: a decode step multiplies a handful of rows (one per running request) by
every weight of the model, and MKL's sgemm behind `F.linear` is slow at such small row
counts. On the 2-core development host, SmolLM2-135M's 30 layers of projections took
36 ms for 1 row, 85 ms for 10 and 103 ms for 16 through `F.linear`; through oneDNN with
the weights reordered once into its blocked layout, 38, 63 and 76-84 ms. From about 64
rows on the two are even, and for prefill chunks (256-512 rows) oneDNN is 6-8% slower;
so the packed copy serves steps of up to `ONEDNN_MAX_ROWS` rows and the plain weight the
rest. The LM head gains most (10 rows: 30 ms plain, 16 ms packed). The price is memory:
a second copy of the projection and LM-head weights (540 MB for SmolLM2-135M in
float32; an engine's resident size grew by 760 MiB); `linear_kernel torch` keeps one.
Results differ from `F.linear` in the last bits of float32 (another summation order),
as any change of batch shape already makes them.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

KERNELS = ("auto", "onednn", "torch")
ONEDNN_MAX_ROWS = 48  # past this many rows MKL's sgemm is as fast as oneDNN (see above)


@dataclass(frozen=True)
class LinearWeight:
    """A projection weight as loaded ([out, in]), plus the kernel's packed copy if any."""

    plain: torch.Tensor
    packed: torch.Tensor | None = None


class LinearKernel(Protocol):
    """Multiplies activations by projection weights. `prepare` runs once per weight at
    load; `apply` takes a 2-D `x` of the model's dtype on the weight's device and only
    weights this same kernel prepared. Prepared weights are read-only afterwards, so
    steps may run from any thread."""

    name: str

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        """Wrap `weight` ([out, in]) with whatever this kernel multiplies fastest."""
        ...

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) for a weight this kernel prepared; x is [rows, in]."""
        ...


class TorchLinear:
    """`F.linear` on the weights as loaded: every device, every dtype."""

    name = "torch"

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        return LinearWeight(weight)

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight.plain, bias)


class OneDnnLinear:
    """Small steps through oneDNN on a pre-packed copy, large ones through `F.linear` (CPU)."""

    name = "onednn"

    def prepare(self, weight: torch.Tensor) -> LinearWeight:
        # The batch-size hint only picks the blocked layout; any row count works after.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
        return LinearWeight(weight, packed)

    def apply(
        self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if weight.packed is None or x.shape[0] > ONEDNN_MAX_ROWS:
            return F.linear(x, weight.plain, bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, weight.packed, bias, "none", [], ""
        )
        return out


def pick_linear_kernel(name: str, device: torch.device, dtype: torch.dtype) -> LinearKernel:
    """The kernel called `name`; "auto" takes oneDNN on x86 CPUs in float32, else torch."""
    if name not in KERNELS:
        raise ValueError(f"linear_kernel must be one of {KERNELS}, got {name!r}")
    onednn_ok = (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )
    if name == "onednn" and not onednn_ok:
        raise ValueError(
            "linear_kernel onednn needs device cpu, dtype float32 and a torch built with "
            f"oneDNN (got device {device.type}, dtype {dtype})"
        )
    # "auto" packs only on x86, where the gain was measured.
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if name == "torch" or (name == "auto" and not (onednn_ok and x86)):
        return TorchLinear()
    return OneDnnLinear()
