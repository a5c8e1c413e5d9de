"""Which of the engine's linear kernels give a row the same bits whatever else is in its
batch, and what a fixed row tile (the simplest cure) costs: `python -m
loadtest.engine.invariance_probe` (about a minute on two cores).

Why: a request's tokens must not depend on what else runs (issue 42). A product's row is
batch-invariant when each output element is reduced in one order whatever the row count;
BLAS and oneDNN pick their blocking, their micro-kernels and the split of the reduction
by the shape, so a row computed beside others can differ in its last bits from the same
row alone, and in bfloat16 one bit decides a greedy token now and then.

What it measures, for each dtype (float32, bfloat16), kernel (`F.linear` on the plain
weight; oneDNN on the pre-packed weight, `engine.linear_kernel.OneDnnLinear`; in float32
also the tiled kernel, `TiledLinear`, which batch invariance runs) and the model's
projections (`machine_roof.projections`: q/k/v fused, o, gate/up fused, down,
LM head):
- **differing rows**: a random set of `batch` rows multiplied together, against each
  row multiplied alone: how many differ in any bit, for each batch size;
- the same with a **fixed row tile** (`--tile-rows`): every product runs as whole tiles
  of exactly that many rows (the last one padded with zeros), so each row goes
  through a product of one shape whatever the batch;
- **the tile's cost**: one layer's projections and the LM head at 1, 8, 32 and 256
  rows, tiled over plain, the median of `--rounds` paired rounds.

One torch thread (`--threads`): the thread count is part of the shape a kernel sees.
The JSON (`--out`) carries the commit, time and host.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import DEFAULT_MODEL_CACHE
from engine.decode_roof import Projection, projections
from engine.linear_kernel import (
    LinearKernel,
    OneDnnLinear,
    TiledLinear,
    onednn_packs_bf16,
    pick_linear_kernel,
)
from engine.model_spec import ModelSpec
from engine.model_store import prepare_default_model
from engine.precision import cpu_has_native_bf16
from loadtest.reports.bench_cli import BenchCli, bench_main

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine/linear_kernel.py",
    "engine/weight_tiles.py",
    "engine/range_split.py",
    "engine/bf16_bits.py",
    "engine/precision.py",
    "loadtest/engine/invariance_probe.py",
    "loadtest/engine/machine_roof.py",
)

SCHEMA = "pdserve.invariance_probe/1"
DTYPES = (torch.float32, torch.bfloat16)
KERNELS = ("torch", "onednn", "tiled")
COST_ROWS = (1, 8, 32, 256)
Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ProbeConfig:
    batch_sizes: tuple[int, ...] = (2, 4, 8, 32, 128)
    tile_rows: int = field(default=16, metadata={"help": "rows of the fixed tile probed"})
    threads: int = field(default=1, metadata={"help": "torch threads"})
    rounds: int = field(default=5, metadata={"help": "paired rounds of each cost"})
    seed: int = field(default=0, metadata={"help": "the weights' and rows' seed"})


@dataclass(frozen=True)
class Differing:
    """One kernel on one projection: rows of a batch whose bits differ from alone."""

    dtype: str
    kernel: str
    tiled: bool
    projection: str  # "in x out"
    by_batch: dict[int, int]  # batch size -> differing rows (of that many)


@dataclass(frozen=True)
class TileCost:
    dtype: str
    kernel: str
    rows: int
    plain_ms: float  # one layer's projections and the LM head, median
    tiled_ms: float
    ratio: float  # tiled / plain, median of paired rounds


@dataclass
class ProbeReport:
    schema: str
    config: ProbeConfig
    native_bf16: bool
    differing: list[Differing] = field(default_factory=list)
    costs: list[TileCost] = field(default_factory=list)


def product(kernel: str, weight: torch.Tensor) -> Product:
    """The engine's own linear kernel of that name (oneDNN always packed, whatever the
    row count; tiled on one thread), so the probe measures exactly what a step runs."""
    makers: dict[str, Callable[[], LinearKernel]] = {
        # as the engine picks it: widened where the CPU has no native bf16
        "torch": lambda: pick_linear_kernel("torch", torch.device("cpu"), weight.dtype),
        "tiled": TiledLinear,
    }
    linear = makers.get(kernel, lambda: OneDnnLinear(max_rows=None))()
    prepared = linear.prepare(weight)
    return lambda x: linear.apply(x, prepared)


def kernels(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels probed in `dtype`: the tiled one multiplies float32 only, and oneDNN
    bf16 only where this CPU lets it pack bf16 weights."""
    if dtype == torch.float32:
        return KERNELS
    skip = {"tiled"} if onednn_packs_bf16() else {"tiled", "onednn"}
    return tuple(k for k in KERNELS if k not in skip)


def tiled(run: Product, tile: int) -> Product:
    """`run` over whole tiles of `tile` rows, the last padded with zero rows."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        pad = -rows % tile
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return torch.cat([run(part) for part in x.split(tile)])[:rows]

    return apply


def differing_rows(
    run: Product, x: torch.Tensor, sizes: Sequence[int], seed: int
) -> dict[int, int]:
    alone = [run(x[i : i + 1]) for i in range(x.shape[0])]
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for size in sizes:
        pick = torch.randperm(x.shape[0], generator=gen)[:size].tolist()
        together = run(x[pick])
        out[size] = sum(not torch.equal(together[j], alone[i][0]) for j, i in enumerate(pick))
    return out


def probe_differing(cfg: ProbeConfig, shapes: Sequence[Projection]) -> list[Differing]:
    rows = max(cfg.batch_sizes)
    out = []
    for dtype in DTYPES:
        for shape in shapes:
            gen = torch.Generator().manual_seed(cfg.seed)
            weight = (torch.randn(shape.rows_out, shape.rows_in, generator=gen) * 0.05).to(dtype)
            x = torch.randn(rows, shape.rows_in, generator=gen).to(dtype)
            for kernel in kernels(dtype):
                plain = product(kernel, weight)
                for tile in (False, True):
                    run = tiled(plain, cfg.tile_rows) if tile else plain
                    counts = differing_rows(run, x, cfg.batch_sizes, cfg.seed)
                    name = f"{shape.rows_in} x {shape.rows_out}"
                    out.append(Differing(str(dtype)[6:], kernel, tile, name, counts))
    return out


def _layer_ms(
    runs: Sequence[Product], shapes: Sequence[Projection], inputs: dict[int, torch.Tensor]
) -> float:
    """Milliseconds for every projection once, each on the input of its width."""
    start = time.perf_counter()
    for run, shape in zip(runs, shapes, strict=True):
        run(inputs[shape.rows_in])
    return (time.perf_counter() - start) * 1000


def probe_costs(cfg: ProbeConfig, shapes: Sequence[Projection]) -> list[TileCost]:
    out = []
    gen = torch.Generator().manual_seed(cfg.seed)
    for dtype in DTYPES:
        weights = [(torch.randn(s.rows_out, s.rows_in, generator=gen) * 0.05).to(dtype)
                   for s in shapes]  # fmt: skip
        for kernel in kernels(dtype):
            plain = [product(kernel, w) for w in weights]
            tile = [tiled(p, cfg.tile_rows) for p in plain]
            for rows in COST_ROWS:
                # Each projection takes its own input width; one input per width.
                inputs = {s.rows_in: torch.randn(rows, s.rows_in).to(dtype) for s in shapes}
                pairs = [
                    (_layer_ms(plain, shapes, inputs), _layer_ms(tile, shapes, inputs))
                    for _ in range(cfg.rounds + 1)  # the first round warms up, dropped
                ]
                pairs = pairs[1:]
                out.append(TileCost(
                    str(dtype)[6:], kernel, rows,
                    statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
                    statistics.median(b / a for a, b in pairs),
                ))  # fmt: skip
    return out


def run(cfg: ProbeConfig) -> ProbeReport:
    torch.set_num_threads(cfg.threads)
    model_dir = prepare_default_model(DEFAULT_MODEL_CACHE.expanduser(), progress=False)
    spec = ModelSpec.from_dir(model_dir)
    shapes = projections(spec, lm_head=True)
    report = ProbeReport(SCHEMA, cfg, cpu_has_native_bf16())
    report.differing = probe_differing(cfg, shapes)
    report.costs = probe_costs(cfg, shapes)
    return report


def format_table(report: ProbeReport) -> str:
    lines = [f"native bf16: {report.native_bf16}; tile {report.config.tile_rows} rows"]
    for d in report.differing:
        how = "tiled" if d.tiled else "plain"
        counts = " ".join(f"{b}:{n}" for b, n in d.by_batch.items())
        lines.append(f"{d.dtype:8s} {d.kernel:6s} {how:5s} {d.projection:14s} differing {counts}")
    for c in report.costs:
        lines.append(f"{c.dtype:8s} {c.kernel:6s} {c.rows:4d} rows: plain {c.plain_ms:8.2f} ms "
                     f"tiled {c.tiled_ms:8.2f} ms ({c.ratio:.2f}x)")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    cli = BenchCli(
        __doc__ or "",
        ProbeConfig,
        Path("bench-results/invariance.json"),
        run,
        format_table,
        ("batch_sizes",),
        measures=MEASURES,
    )
    return bench_main(cli, argv)


if __name__ == "__main__":
    sys.exit(main())
