"""This machine's roofs: peak GEMM throughput per dtype, read bandwidth, and the roof they
make at a model's shapes; and the model's own projections' throughput beside them.

Lifecycle: `roofline_bench` calls `read_bandwidth()` once, then `roof(spec, dtype, rows,
...)` for each point, in the same run (and thread count) as the engine measurements it
divides by them.

The model's projection shapes, their FLOPs and their weights' bytes are the engine's
(`engine.decode_roof`, which the workers' live roof gauge uses too).

A roof must be an upper bound: a fraction above 1 says the roof was measured wrong, not
that the engine beat the machine (issue 43: on a host with half-width AVX-512 units the
engine's batch-1 decode measured 1.25 of its "roof" when that was the projections'
throughput alone). So the roof at `rows` rows is the classic one, the lesser of
- `peak_gflops`: the best GFLOPS of large products (`PEAK_SHAPES`, bound by arithmetic)
  through every kernel pdserve may use for the dtype, at the engine's thread count; and
- the memory bound: the FLOPs of a step at `rows` rows over the time to read every
  projection weight once at `read_bandwidth()`, measured with every core this process
  may use (one stream per core: more than one engine thread can draw);
and never below `gemm_roof` at the same shapes, so that no kernel measured in the same
run is above it.

`gemm_roof` is the throughput of the model's own projections, every layer's set (q/k/v
fused, o, gate/up fused, down; each layer its own weights, so that, as in a real step,
no weight is still in cache when it is used again) plus the LM head when `lm_head` is
set, multiplied in order at `rows` rows with the kernel pdserve uses for the dtype:
oneDNN on pre-packed weights for float32 and bfloat16, except that bfloat16 at up to
`fused_decode.max_rows()` rows takes the fused decode's products where the engine fuses
(`engine.weight_tiles`, which is faster there at every such row count); `torch._int_mm`
on int8 (no activation quantization counted: the roof is the multiply alone).
Throughput is their FLOPs over their time: what an engine that did nothing but these
products would reach. At one row it is bound by memory, at 256 by arithmetic.

Read bandwidth is a sum over a buffer far larger than the caches (bytes read over time,
nothing written, as a decode step reads its weights), with torch's threads set to the
cores this process may use for the measurement, the best of that and the engine's own
thread count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import DecodeKernel
from engine.decode_roof import Projection, linear_flops, projections
from engine.fused_decode import fused_decode_wanted, max_rows
from engine.linear_kernel import onednn_packs_bf16, pick_linear_kernel
from engine.model_spec import ModelSpec
from engine.precision import WeightQuant

#: Seconds each timing loop runs for (after two untimed calls).
TIME_S = 0.3
BANDWIDTH_BYTES = 512 << 20
#: (rows, input features, output features) of the products `peak_gflops` tries: large
#: enough to be bound by arithmetic on a CPU, square and wide.
PEAK_SHAPES = ((512, 2048, 2048), (1024, 1024, 4096), (2048, 2048, 2048))


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
    if dt == torch.bfloat16 and not onednn_packs_bf16():
        # oneDNN refuses bf16 here: the torch kernel as the engine picks it (widened)
        kernel = pick_linear_kernel("auto", torch.device("cpu"), dt)
        prepared = kernel.prepare(w)
        return lambda: kernel.apply(x, prepared)
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


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def read_bandwidth() -> float:
    """GB/s of reading a large buffer: a sum, the best of every core this process may use
    and of torch's current thread count (restored after)."""
    buf = torch.ones(BANDWIDTH_BYTES // 4)
    threads = torch.get_num_threads()
    best = 0.0
    try:
        for n in sorted({threads, _cores()}):
            torch.set_num_threads(n)
            best = max(best, BANDWIDTH_BYTES / seconds_per_call(buf.sum) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return best


def peak_gflops(dtype: str) -> float:
    """The best GFLOPS of `PEAK_SHAPES` in `dtype` (float32, bfloat16 or int8) through each
    kernel pdserve may use for it, at torch's current thread count."""
    best = 0.0
    for rows, features_in, features_out in PEAK_SHAPES:
        p = Projection(features_in, features_out)
        flops = 2.0 * rows * features_in * features_out
        for product in _kernels(p, dtype, rows):
            best = max(best, flops / seconds_per_call(product) / 1e9)
    return best


def _kernels(p: Projection, dtype: str, rows: int) -> list[Callable[[], object]]:
    """Every way pdserve may multiply in `dtype`: its kernel at this shape, and plain
    torch (which a `linear_kernel torch` engine uses)."""
    if dtype == "int8":
        return [_product(p, dtype, rows)]
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, p.rows_in, generator=gen).to(dt)
    w = torch.randn(p.rows_out, p.rows_in, generator=gen).to(dt)
    return [_product(p, dtype, rows), lambda: torch.nn.functional.linear(x, w)]


def memory_bound_gflops(
    spec: ModelSpec, rows: int, element_size: float, read_gb_s: float, *, lm_head: bool
) -> float:
    """GFLOPS of a step at `rows` rows that takes only the time to read its weights once."""
    weights = linear_flops(spec, 1, lm_head=lm_head) / 2 * element_size
    return linear_flops(spec, rows, lm_head=lm_head) / (weights / (read_gb_s * 1e9)) / 1e9


@dataclass(frozen=True)
class Roof:
    """The roof at one shape (`gflops`) and what it was made of."""

    gflops: float
    peak_gflops: float
    memory_bound_gflops: float
    kernel_gflops: float  # `gemm_roof`: the model's projections through pdserve's kernel


def roof(spec: ModelSpec, dtype: str, rows: int, element_size: float, read_gb_s: float,
         peak: float, *, lm_head: bool) -> Roof:  # fmt: skip
    """The upper bound at `rows` rows: min(peak, memory bound), and never below what the
    model's own projections reached (`gemm_roof`)."""
    mem = memory_bound_gflops(spec, rows, element_size, read_gb_s, lm_head=lm_head)
    kernel = gemm_roof(spec, dtype, rows, lm_head=lm_head)
    return Roof(max(min(peak, mem), kernel), peak, mem, kernel)
