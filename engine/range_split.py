"""Runs one compiled kernel over ranges of its work on several threads: the first range
on the calling thread, the rest on a pool, and returns when all are done.

Lifecycle: a kernel's owner (`engine.linear_kernel.TiledLinear`,
`engine.row_attention.RowAttention`) keeps one pool of `threads - 1` workers for its
life and calls `run_ranges` per product. The kernels release the GIL (numba `nogil`),
so the ranges run in parallel; each range writes its own part of the output, so the
split changes no bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor


def run_ranges(
    pool: ThreadPoolExecutor | None,
    work: Callable[[int, int], None],
    ranges: Sequence[tuple[int, int]],
) -> None:
    """`work(start, end)` for every range, the first on this thread; without a pool,
    only the first range runs (a caller without one makes a single range)."""
    pending = [pool.submit(work, a, b) for a, b in ranges[1:]] if pool is not None else []
    work(*ranges[0])
    for done in pending:
        done.result()
