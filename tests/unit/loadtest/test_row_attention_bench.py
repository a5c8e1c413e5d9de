"""The row-attention benchmark's checks on the engine's own backends (a pool laid out as
the engine's, no model), and the section docs/benchmarks.md renders from its report."""

from __future__ import annotations

from dataclasses import asdict

import torch

from engine.attention import AttentionBackend, AttentionMetadata, select_backend
from engine.config import AttentionBackendName
from engine.kv_cache import LayerKv
from loadtest.engine.row_attention_bench import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    Case,
    RowBenchConfig,
    RowBenchReport,
    differing_decode,
    differing_prefill,
)
from loadtest.reports.engine_sections import row_attention
from loadtest.reports.result_file import jsonable


def test_the_checks_find_changed_rows_and_the_row_kernel_none() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = LayerKv(torch.randn(260, 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)[:, 2:4])
    cpu, f32 = torch.device("cpu"), torch.float32
    sdpa = select_backend(AttentionBackendName.TORCH, cpu, f32)
    rows = select_backend(AttentionBackendName.TORCH, cpu, f32, invariant=True)
    q = torch.randn(256, HEADS, HEAD_DIM, generator=gen)
    assert differing_prefill(rows, q, cache, 256, 1024) == 0
    assert differing_prefill(sdpa, q, cache, 256, 1024) > 0  # the check can fail
    assert differing_decode(rows, q[:8], cache, 8, 512) == 0
    # Whether SDPA's decode rows change batched depends on the CPU (on an AVX2-only one
    # they did not), so the decode check is shown able to fail on a backend that does.
    assert differing_decode(_BatchSensitive(rows), q[:8], cache, 8, 512) == 7


class _BatchSensitive(AttentionBackend):
    """`inner`, but every row after a step's first moves by one ulp."""

    name = "batch-sensitive"

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    def plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> object:
        return self.inner.plan(meta, block_size, device)

    def attend(self, q: torch.Tensor, cache: LayerKv, meta: AttentionMetadata) -> torch.Tensor:
        out = self.inner.attend(q, cache, meta)
        out[1:] = torch.nextafter(out[1:], torch.full_like(out[1:], float("inf")))
        return out


def test_the_section_shows_both_sides_medians_and_differing_rows() -> None:
    report = RowBenchReport("pdserve.row_attention_bench/1", RowBenchConfig(rounds=3))
    report.cases = [Case("prefill", 256, 1024, [10.0, 12.0, 11.0], [30.0, 33.0, 31.0], 2.8, 170, 0)]
    data = jsonable(asdict(report))
    assert isinstance(data, dict)
    text = "\n".join(row_attention(data))
    assert "| prefill | 256 x 1024 | 11.00 | 31.00 | 2.80x | 170 / 0 of 256 |" in text
    assert "median of 3 paired rounds" in text
