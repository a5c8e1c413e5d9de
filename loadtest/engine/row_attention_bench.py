"""Attention by rows (`engine.row_attention`, what batch invariance runs in float32)
against the attention it replaces, per layer call: `python -m
loadtest.engine.row_attention_bench` (about 2 minutes on two cores).

Why: with `batch_invariant` on, every decode and prefill row attends through the row
kernel so that a token's bits depend on its own tokens alone (issue 42). Off, the float32
engine runs torch's SDPA: decode rows in groups padded to their longest context, a
prefill chunk as one call. This measures what the guarantee costs in attention alone, by
shape, and checks the property on both: the engine's own `AttentionBackend`, invariant or
not, over a random float32 pool laid out as the engine's (the model's heads, 16-token
blocks, one layer's strided view), with metadata as a step builds it.

What it measures, per case (decode: rows x context; prefill: one chunk's queries over
its keys, the chunk the last of its prompt):
- **milliseconds per layer call** (plan once, then `--calls` calls, as a step's layers
  do), each side, `--rounds` paired rounds in alternating order; the median of the
  rounds' ratios (rows / SDPA) beside each side's median and best;
- **differing rows**: decode rows together against each alone; a prefill chunk as one
  call against the same rows cut into three calls (another budget, a prefix-cache hit):
  rows whose output differs in any bit.

`--threads` torch threads, and as many for the row kernel: the engine gives both the
same count. The JSON (`--out`) carries the commit, time and host.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import AttentionBackend, AttentionMetadata, select_backend
from engine.config import AttentionBackendName
from engine.kv_cache import LayerKv
from loadtest.reports.bench_cli import BenchCli, bench_main

#: The source paths these numbers describe (`loadtest.reports.sources`): a change to
#: any of them marks a committed result of this benchmark stale.
MEASURES = (
    "engine/row_attention.py",
    "engine/range_split.py",
    "engine/decode_kernel.py",
    "engine/attention.py",
    "engine/tiled_attention.py",
    "engine/kv_cache.py",
    "loadtest/engine/row_attention_bench.py",
)

SCHEMA = "pdserve.row_attention_bench/1"
BLOCK = 16
#: SmolLM2-135M's attention: query heads, KV heads, head dimension.
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
#: (rows, context) of decode steps; (queries, keys) of prefill chunks.
DECODES = ((1, 256), (8, 512), (32, 512), (8, 2048))
PREFILLS = ((128, 128), (256, 256), (256, 1024), (512, 512), (512, 2048))


@dataclass(frozen=True)
class RowBenchConfig:
    threads: int = field(default=1, metadata={"help": "threads of each side"})
    rounds: int = field(default=7, metadata={"help": "paired rounds per case"})
    calls: int = field(default=10, metadata={"help": "layer calls per round"})
    seed: int = field(default=0, metadata={"help": "the pool's and queries' seed"})


@dataclass(frozen=True)
class Case:
    kind: str  # decode or prefill
    rows: int  # decode rows, or the chunk's queries
    context: int  # tokens each decode row sees, or the chunk's last query sees
    sdpa_ms: list[float]  # per round, one layer call
    rows_ms: list[float]
    ratio_median: float  # median over rounds of rows / sdpa
    sdpa_differing: int  # rows whose bits change with the batch or the chunking
    rows_differing: int


@dataclass
class RowBenchReport:
    schema: str
    config: RowBenchConfig
    cases: list[Case] = field(default_factory=list)


def meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """A step's metadata as the model runner builds it (decodes first)."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        num_decodes=sum(1 for q in query_lens if q == 1),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


def attend(
    backend: AttentionBackend, q: torch.Tensor, cache: LayerKv, m: AttentionMetadata
) -> torch.Tensor:
    m.plan = backend.plan(m, BLOCK, torch.device("cpu"))
    return backend.attend(q, cache, m)


def layer_ms(
    backend: AttentionBackend, q: torch.Tensor, cache: LayerKv, m: AttentionMetadata, calls: int
) -> float:
    start = time.perf_counter()
    m.plan = backend.plan(m, BLOCK, torch.device("cpu"))
    for _ in range(calls):
        backend.attend(q, cache, m)
    return (time.perf_counter() - start) * 1000 / calls


def decode_step(rows: int, context: int) -> AttentionMetadata:
    per = -(-context // BLOCK)
    return meta(
        [1] * rows, [context] * rows, [list(range(r * per, (r + 1) * per)) for r in range(rows)]
    )


def differing_decode(
    backend: AttentionBackend, q: torch.Tensor, cache: LayerKv, rows: int, context: int
) -> int:
    """Decode rows of slightly different contexts together against each alone."""
    per = -(-context // BLOCK)
    tables = [list(range(r * per, (r + 1) * per)) for r in range(rows)]
    lens = [context - (r * 7) % min(context, BLOCK * 2) for r in range(rows)]
    together = attend(backend, q, cache, meta([1] * rows, lens, tables))
    return sum(
        not torch.equal(
            attend(backend, q[r : r + 1], cache, meta([1], [lens[r]], [tables[r]]))[0], together[r]
        )
        for r in range(rows)
    )


def differing_prefill(
    backend: AttentionBackend, q: torch.Tensor, cache: LayerKv, rows: int, context: int
) -> int:
    """The chunk of `rows` queries as one call against the same rows in three calls."""
    table = [list(range(-(-context // BLOCK)))]
    whole = attend(backend, q, cache, meta([rows], [context], table))
    first = context - rows
    cuts = [0, rows // 3, 2 * rows // 3, rows]
    parts = [
        attend(backend, q[a:b], cache, meta([b - a], [first + b], table))
        for a, b in itertools.pairwise(cuts)
    ]
    return sum(not torch.equal(x, y) for x, y in zip(torch.cat(parts), whole, strict=True))


def run(cfg: RowBenchConfig) -> RowBenchReport:
    torch.set_num_threads(cfg.threads)
    gen = torch.Generator().manual_seed(cfg.seed)
    blocks = max(r * -(-c // BLOCK) for r, c in DECODES) + 8
    pool = torch.randn(blocks, 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)  # two layers
    cache = LayerKv(pool[:, 2:4])  # the second layer's strided view, as the engine's
    cpu, f32 = torch.device("cpu"), torch.float32
    sides = {
        "sdpa": select_backend(AttentionBackendName.TORCH, cpu, f32),
        "rows": select_backend(AttentionBackendName.TORCH, cpu, f32, invariant=True),
    }
    report = RowBenchReport(SCHEMA, cfg)
    cases = [("decode", r, c) for r, c in DECODES] + [("prefill", q, c) for q, c in PREFILLS]
    for kind, rows, context in cases:
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
        if kind == "decode":
            m = decode_step(rows, context)
            check = differing_decode
        else:
            m = meta([rows], [context], [list(range(-(-context // BLOCK)))])
            check = differing_prefill
        times: dict[str, list[float]] = {k: [] for k in sides}
        for backend in sides.values():  # warm-up: compiles the row kernel
            layer_ms(backend, q, cache, m, 1)
        for r in range(cfg.rounds):
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                times[name].append(layer_ms(sides[name], q, cache, m, cfg.calls))
        ratio = statistics.median(b / a for a, b in zip(times["sdpa"], times["rows"], strict=True))
        diffs = {k: check(b, q, cache, rows, context) for k, b in sides.items()}
        report.cases.append(Case(kind, rows, context, times["sdpa"], times["rows"], ratio,
                                 diffs["sdpa"], diffs["rows"]))  # fmt: skip
        print(f"{kind} {rows} x {context}: sdpa {statistics.median(times['sdpa']):.2f} ms, rows "
              f"{statistics.median(times['rows']):.2f} ms ({ratio:.2f}x)", flush=True)  # fmt: skip
    return report


def format_table(report: RowBenchReport) -> str:
    lines = [f"attention per layer call, float32, {report.config.threads} thread(s)"]
    for c in report.cases:
        lines.append(
            f"{c.kind:7s} {c.rows:3d} x {c.context:5d}: sdpa {statistics.median(c.sdpa_ms):7.2f} "
            f"ms  rows {statistics.median(c.rows_ms):7.2f} ms  rows/sdpa {c.ratio_median:.2f}x  "
            f"differing rows: sdpa {c.sdpa_differing}, rows {c.rows_differing} of {c.rows}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    cli = BenchCli(
        __doc__ or "",
        RowBenchConfig,
        Path("bench-results/row_attention.json"),
        run,
        format_table,
        measures=MEASURES,
    )
    return bench_main(cli, argv)


if __name__ == "__main__":
    sys.exit(main())
