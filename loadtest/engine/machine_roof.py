"""This machine's roofs at a model's shapes: GEMM throughput per dtype, and memory bandwidth.

Lifecycle: `roofline_bench` calls `gemm_roof(spec, dtype, rows)` and `bandwidth()` in
the same run (and thread count) as the engine measurements it divides by them.

A GEMM roof is the throughput of the model's own projections, every layer's set (q/k/v
fused, o, gate/up fused, down; each layer its own weights, so that, as in a real step,
no weight is still in cache when it is used again) plus the LM head when `lm_head` is
set, multiplied in order at `rows` rows with the kernel pdserve uses for the dtype:
oneDNN on pre-packed weights for float32 and bfloat16, except that bfloat16 at up to
`fused_decode.max_rows()` rows takes the fused decode's products where the engine fuses
(`engine.weight_tiles`, which is faster there at every such row count); `torch._int_mm`
on int8 (no activation quantization counted: the roof is the multiply alone).
Throughput is their FLOPs over their time: what an engine that did nothing but these
products would reach. At one row it is bound by memory, at 256 by arithmetic.

Bandwidth is a copy of a buffer far larger than the caches (bytes read plus bytes
written, over time): the bound of a step that must stream every weight once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import DecodeKernel
from engine.fused_decode import fused_decode_wanted, max_rows
from engine.model_spec import ModelSpec
from engine.precision import WeightQuant

#: Seconds each timing loop runs for (after two untimed calls).
TIME_S = 0.3
BANDWIDTH_BYTES = 512 << 20


@dataclass(frozen=True)
class Projection:
    rows_in: int  # the weight's input features
    rows_out: int  # its output features


def projections(spec: ModelSpec, *, lm_head: bool) -> list[Projection]:
    """One layer's projections (the step repeats them num_layers times) and the LM head."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    h, inter = spec.hidden_size, spec.intermediate_size
    out = [Projection(h, q + 2 * kv), Projection(q, h), Projection(h, 2 * inter),
           Projection(inter, h)]  # fmt: skip
    return [*out, Projection(h, spec.vocab_size)] if lm_head else out


def linear_flops(spec: ModelSpec, rows: int, *, lm_head: bool) -> float:
    """FLOPs (2 per multiply-add) of every projection of the model at `rows` rows."""
    layer = sum(p.rows_in * p.rows_out for p in projections(spec, lm_head=False))
    head = spec.hidden_size * spec.vocab_size if lm_head else 0
    return 2.0 * rows * (layer * spec.num_layers + head)


def linear_weight_bytes(spec: ModelSpec, element_size: float) -> float:
    """Bytes of every projection weight and the LM head, stored `element_size` wide."""
    params = linear_flops(spec, 1, lm_head=True) / 2
    return params * element_size


def seconds_per_call(fn: Callable[[], object]) -> float:
    fn()
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < TIME_S:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def _product(p: Projection, dtype: str, rows: int) -> Callable[[], object]:
    """One projection's multiply at `rows` rows, as pdserve's kernel for `dtype` runs it."""
    gen = torch.Generator().manual_seed(p.rows_out)
    if dtype == "int8":
        x8 = torch.randint(-127, 127, (rows, p.rows_in), dtype=torch.int8, generator=gen)
        w8 = torch.randint(-127, 127, (p.rows_out, p.rows_in), dtype=torch.int8, generator=gen)
        wt = w8.t()
        return lambda: torch._int_mm(x8, wt)
    dt = getattr(torch, dtype)
    x = torch.randn(rows, p.rows_in, generator=gen).to(dt)
    w = torch.randn(p.rows_out, p.rows_in, generator=gen).to(dt)
    if dt == torch.bfloat16 and _fuses_here() and rows <= max_rows():
        from engine.weight_tiles import matmul, pack

        tiles = pack(w.view(torch.int16).numpy().view(np.uint16))
        xf, out = x.float().numpy(), np.empty((rows, p.rows_out), dtype=np.float32)
        return lambda: matmul(tiles, xf, out)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _fuses_here() -> bool:
    """Whether a bfloat16 engine on this CPU runs its small decode steps fused."""
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    return fused_decode_wanted(DecodeKernel.AUTO, cpu, bf16, WeightQuant.NONE, bf16)


def gemm_roof(spec: ModelSpec, dtype: str, rows: int, *, lm_head: bool) -> float:
    """GFLOPS of the model's projections at `rows` rows in `dtype` (float32, bfloat16 or
    int8): every layer's, in order, on weights of their own."""
    layer = projections(spec, lm_head=False)
    calls = [_product(p, dtype, rows) for _ in range(spec.num_layers) for p in layer]
    if lm_head:
        calls.append(_product(Projection(spec.hidden_size, spec.vocab_size), dtype, rows))

    def model_pass() -> None:
        for call in calls:
            call()

    return linear_flops(spec, rows, lm_head=lm_head) / seconds_per_call(model_pass) / 1e9


def bandwidth() -> float:
    """GB/s of a large copy, bytes read plus written."""
    src = torch.ones(BANDWIDTH_BYTES // 4)
    dst = torch.empty_like(src)
    return 2 * BANDWIDTH_BYTES / seconds_per_call(lambda: dst.copy_(src)) / 1e9
