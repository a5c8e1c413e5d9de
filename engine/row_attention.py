"""Attention one query row at a time, each over its own positions in one fixed order:
the batch-invariant attention of a float32 engine on the CPU.

Lifecycle: `engine.attention.TorchAttention(invariant=True)` holds one `RowAttention`
for the engine's life. At a step's first layer `plan` computes where every row's cached
tokens sit in the pool (shared by the step's layers); each layer's `attend` then runs
the compiled kernel over all of the step's rows, decode and prefill alike, split by
rows over the engine's threads.

Why: a row's attention should be a function of its own query and of the keys and values
at its positions, nothing else. torch's SDPA picks its blocking, so the order of its
sums, by the call's shape: how many queries a prefill chunk has and how many keys it
sees. A prompt cut into other chunks (another step budget, other prompts sharing it, a
prefix-cache hit that starts mid-prompt), a token computed by a decode step instead of
inside a prefill (a migrated or preempted stream's output, a verification row of
speculation) went through calls of other shapes, and its last bits changed; so did
every later token's. Here row r, at position `lens[r] - 1`, always runs the same
instructions: one pass over its keys in position order for every query head's scores,
a softmax per head, one pass over its values in position order. So a token's bits
depend only on the tokens up to it, whichever path computed it (decode, prefill chunk,
verification) and whatever else the step holds.

Numerics: float32 throughout; e**x by `engine.decode_kernel.exp_f32` (within 1.5 ulp).
Sums are compiled with reassociation, so LLVM vectorizes them, and the lanes it splits
a sum into follow from the loop alone (head_dim is a compile-time constant; a row's key
count is its own): the same row gives the same bits in any call. What it costs against
SDPA, by context length and chunk size: docs/engine.md "Batch invariance".
"""

from __future__ import annotations

import functools
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch

from engine import decode_kernel
from engine.decode_kernel import (
    FAST_MATH,
    NUMPY_ERRORS,
    check_heads,
    exp_f32,
    row_bases,
    source_digest,
)
from engine.range_split import run_ranges

_F32 = np.float32

#: `exp_f32` compiles into the entry point from another file, which numba's disk cache does
#: not stamp: the digest rides in the entry point's closure (as in `engine.decode_kernel`).
_INLINED_DIGEST = source_digest(decode_kernel)


@numba.njit(nogil=True, fastmath=FAST_MATH, error_model=NUMPY_ERRORS)  # uncached: see digest
def _attend_block(
    q: np.ndarray, out: np.ndarray, pool: np.ndarray, base: np.ndarray, k_off: int,
    v_off: int, len0: int, scores: np.ndarray, heads: int, kv_heads: int, hd: int,
) -> None:  # fmt: skip
    """Attention of consecutive queries of one sequence, `q` ([n, heads * hd]), into
    `out`: row j sees the sequence's first `len0 + j` tokens, token p's K row ([kv_heads
    * hd] float32) at element `base[p] + k_off` of `pool` and its V row at `base[p] +
    v_off`. `scores` ([>= n, heads, >= len0 + n - 1]) is scratch. Query head h reads KV
    head h // (heads // kv_heads).

    The rows share each K and V row's load (it stays in L1 while they use it), but not
    one operation: row j's scores, softmax and sums are the same instructions in the same
    order as if it were the block's only row, so it gets the same bits in a block of any
    size (a decode row is a block of one)."""
    n = q.shape[0]
    group = heads // kv_heads
    width = kv_heads * hd
    scale = _F32(1.0 / math.sqrt(hd))
    last = len0 + n - 1  # the tokens the last row sees
    for p in range(last):
        k = pool[base[p] + k_off : base[p] + k_off + width]
        for j in range(max(p - len0 + 1, 0), n):  # the rows that see token p
            row = q[j]
            for h in range(heads):
                qh, kh = h * hd, (h // group) * hd
                s = _F32(0.0)
                for d in range(hd):
                    s += row[qh + d] * k[kh + d]
                scores[j, h, p] = s * scale
    for j in range(n):
        for h in range(heads):
            _softmax(scores[j, h, : len0 + j])
    out[:n] = 0.0
    for p in range(last):
        v = pool[base[p] + v_off : base[p] + v_off + width]
        for j in range(max(p - len0 + 1, 0), n):
            acc = out[j]
            for h in range(heads):
                qh, vh = h * hd, (h // group) * hd
                w = scores[j, h, p]
                for d in range(hd):
                    acc[qh + d] += w * v[vh + d]


@numba.njit(nogil=True, fastmath=FAST_MATH, error_model=NUMPY_ERRORS)  # uncached: see digest
def _softmax(x: np.ndarray) -> None:
    """In place, in float32: e**(x - max) over its total."""
    top = x[0]
    for p in range(1, x.shape[0]):
        top = max(top, x[p])
    total = _F32(0.0)
    for p in range(x.shape[0]):
        weight = exp_f32(x[p] - top)
        x[p] = weight
        total += weight
    for p in range(x.shape[0]):
        x[p] /= total


@functools.cache
def row_kernel(heads: int, kv_heads: int, hd: int) -> Any:
    """The compiled kernel for these attention dimensions (held as constants, so the
    head loop's sums vectorize the same way in every call; one per process and shape,
    cached on disk). `attend(q, pool, bases, blocks, k_off, v_off, out, lo, hi)` attends
    blocks `lo` to `hi` of `blocks` ([count, 4] int64: first row, rows, sequence, tokens
    its first row sees) of `q` ([rows, heads * hd] float32) into `out`; sequence s's
    token p has its K row at element `bases[s, p] + k_off` of `pool` and its V row at
    `+ v_off`."""
    check_heads(heads, kv_heads, hd)
    digest = _INLINED_DIGEST

    @numba.njit(cache=True, nogil=True)
    def attend(
        q: np.ndarray, pool: np.ndarray, bases: np.ndarray, blocks: np.ndarray, k_off: int,
        v_off: int, out: np.ndarray, lo: int, hi: int,
    ) -> None:  # fmt: skip
        digest  # noqa: B018 -- read so that the closure, which the cache keys on, holds it
        most, longest = 1, 1
        for b in range(lo, hi):
            most = max(most, blocks[b, 1])
            longest = max(longest, blocks[b, 3] + blocks[b, 1] - 1)
        scores = np.empty((most, heads, longest), dtype=np.float32)
        for b in range(lo, hi):
            r, n, seq, len0 = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3]
            _attend_block(q[r : r + n], out[r : r + n], pool, bases[seq], k_off, v_off,
                          len0, scores, heads, kv_heads, hd)  # fmt: skip

    return attend


def token_offsets(kv: torch.Tensor, tables: np.ndarray, seq_lens: list[int]) -> np.ndarray:
    """[sequences, longest] element offsets of each sequence's tokens within one layer's
    K rows of `kv` ([blocks, 2, block_size, kv_heads, head_dim], a strided view of the
    pool), after checking that `tables` ([sequences, >= blocks] block ids) stay in the
    pool and cover `seq_lens`: the compiled kernels that read them have no bounds
    checks (the gathers they replace raised on a bad block id), so IndexError here."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    block_size = kv.shape[2]
    if (
        tables.min(initial=0) < 0
        or tables.max(initial=0) >= kv.shape[0]
        or lens.max(initial=0) > tables.shape[1] * block_size
    ):
        raise IndexError("attention over blocks outside the KV pool")
    if not len(lens):
        return np.zeros((0, 1), dtype=np.int64)
    return row_bases(tables, lens, block_size, kv.stride(0), kv.stride(2))


@dataclass
class RowPlan:
    """A step's rows for `RowAttention.attend`, shared by its layers."""

    bases: np.ndarray  # [sequences, longest] int64: each sequence's token offsets
    blocks: np.ndarray  # [count, 4] int64: first row, rows, sequence, its first row's tokens
    ranges: list[tuple[int, int]]  # blocks per thread, of about equal work


class RowAttention:
    """Runs `row_kernel` over a step's rows on `threads` threads (the caller's and a
    pool's). A prefill chunk's rows go in blocks of up to `BLOCK_ROWS` consecutive rows,
    a decode row alone; blocks go to threads whole. Neither the blocks nor the split
    change a row's bits (`_attend_block`)."""

    #: Rows of a chunk that share each K and V row's load: enough that a long context's
    #: K and V, read from L2 or beyond for every block, cost little per row.
    BLOCK_ROWS = 8
    #: Tokens seen (summed over rows) below which a step runs on the calling thread
    #: alone: handing work to another thread costs tens of microseconds.
    SPLIT_WORK = 1 << 11

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(threads, 1)
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None
        self._flat: dict[int, np.ndarray] = {}  # the pool's float32 view by storage address

    def plan(self, kv: torch.Tensor, tables: torch.Tensor, query_lens: list[int],
             seq_lens: list[int]) -> RowPlan:  # fmt: skip
        """Where each row's tokens sit in `kv` ([blocks, 2, block_size, kv_heads,
        head_dim], strided): sequence i has `query_lens[i]` new rows, the last of them
        at position `seq_lens[i] - 1`. Raises IndexError for a table that points outside
        the pool or does not cover its sequence (the kernel has no bounds checks)."""
        bases = token_offsets(kv, tables[: len(seq_lens)].numpy(), seq_lens)
        if not len(seq_lens):
            return RowPlan(bases, np.zeros((0, 4), np.int64), [])
        blocks = self._blocks(query_lens, seq_lens)
        return RowPlan(bases, blocks, self._ranges(blocks))

    def _blocks(self, query_lens: list[int], seq_lens: list[int]) -> np.ndarray:
        """[count, 4]: each block's first row, rows, sequence and the tokens its first
        row sees (row j of a sequence's new rows sits at seq_len - query_len + j)."""
        out = []
        row = 0
        for seq, (n, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            for j in range(0, n, self.BLOCK_ROWS):
                rows = min(self.BLOCK_ROWS, n - j)
                out.append((row + j, rows, seq, seq_len - n + j + 1))
            row += n
        return np.array(out, dtype=np.int64).reshape(-1, 4)

    def _ranges(self, blocks: np.ndarray) -> list[tuple[int, int]]:
        """Contiguous ranges of blocks of about equal work (the tokens their rows see)."""
        count = len(blocks)
        rows, len0 = blocks[:, 1], blocks[:, 3]
        work = rows * len0 + rows * (rows - 1) // 2
        total = int(work.sum())
        parts = min(self.threads, count, max(total // self.SPLIT_WORK, 1))
        if parts <= 1:
            return [(0, count)]
        cut = np.searchsorted(np.cumsum(work), [total * i / parts for i in range(1, parts)])
        edges = [0, *sorted(set(int(c) + 1 for c in cut if 0 <= c < count - 1)), count]
        return [(a, b) for a, b in itertools.pairwise(edges) if b > a]

    def attend(self, q: torch.Tensor, kv: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """Every row of `q` ([rows, heads, head_dim] float32) over its own tokens of
        `kv` (one layer's view of the pool, float32). Returns [rows, heads, head_dim]."""
        rows, heads, hd = q.shape
        if not rows:
            return torch.empty_like(q)
        attend = row_kernel(heads, kv.shape[3], hd)
        qf = q.reshape(rows, heads * hd).contiguous().numpy()
        out = np.empty_like(qf)
        k_off = kv.storage_offset()
        args: tuple[Any, ...] = (qf, self._flat_pool(kv), plan.bases, plan.blocks, k_off,
                                 k_off + kv.stride(1), out)  # fmt: skip
        run_ranges(self._pool, functools.partial(attend, *args), plan.ranges)
        return torch.from_numpy(out).view(rows, heads, hd)

    def _flat_pool(self, kv: torch.Tensor) -> np.ndarray:
        """The whole pool under `kv` as one float32 array (one view per pool, kept)."""
        storage = kv.untyped_storage()
        key = storage.data_ptr()
        if key not in self._flat:
            flat = kv.as_strided((storage.nbytes() // kv.element_size(),), (1,), 0)
            self._flat[key] = flat.numpy()
        return self._flat[key]
