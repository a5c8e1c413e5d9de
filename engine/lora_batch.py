"""One step's LoRA: every adapter in the batch applied to its own rows, in one pass.

Lifecycle: the model runner builds a `LoraBatch` per step from the rows' adapters
(`LoraBatch.of`; None when no row has one) and the model calls `add(key, x, y)` after
each fused projection. The adapters' weights are stacked per projection for the set of
adapters in the batch (`LoraStacks`, a small LRU: a decode batch keeps its mix for many
steps) and the step's rows pick their own block with a one-hot mask:

    mid = x @ [A_1 | A_2 | ... | A_n]        (rows x n*R: every adapter on every row)
    mid *= onehot(row's adapter)             (other adapters' columns zeroed; base rows: all)
    y  += mid @ [B_1 ; B_2 ; ... ; B_n]

Three ops per projection whatever the mix (no per-adapter gathers or scatters, which at
decode batch sizes cost more in dispatch than the arithmetic). The extra work is
rows x n*R x (in + out) multiply-adds, which for ranks of 8-16 is a few percent of the
projection itself per adapter. With one adapter on every row the mask is skipped; rows
without an adapter get exactly zero (their columns are masked before B).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.lora import LoraAdapter

#: Adapter sets whose stacked weights are kept. Each entry holds a copy of its adapters'
#: weights, also after an adapter is evicted from the `LoraSet`, so this bounds that
#: memory: at most STACK_CACHE x max_loras adapters' worth.
STACK_CACHE = 4


@dataclass(frozen=True)
class Stacked:
    """One fused projection's weights of every adapter in a mix, each padded to `rank`."""

    a_t: torch.Tensor  # [in, n * rank]
    b_t: torch.Tensor  # [n * rank, out]
    rank: int


class LoraStacks:
    """Stacked weights by adapter set (digests, sorted), least recently used out."""

    def __init__(self, size: int = STACK_CACHE) -> None:
        self.size = size
        self._cache: OrderedDict[tuple[str, ...], dict[str, Stacked]] = OrderedDict()

    def get(self, adapters: Sequence[LoraAdapter]) -> dict[str, Stacked]:
        key = tuple(a.digest for a in adapters)
        stacks = self._cache.get(key)
        if stacks is None:
            stacks = _stack(adapters)
            self._cache[key] = stacks
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return stacks


def _stack(adapters: Sequence[LoraAdapter]) -> dict[str, Stacked]:
    keys = sorted({k for a in adapters for k in a.pairs})
    out: dict[str, Stacked] = {}
    for key in keys:
        pairs = [a.pairs.get(key) for a in adapters]
        some = next(p for p in pairs if p is not None)
        rank = max(p.rank for p in pairs if p is not None)
        fan_in, fan_out = some.a_t.shape[0], some.b_t.shape[1]
        dtype, dev = some.a_t.dtype, some.a_t.device
        a_blocks, b_blocks = [], []
        for p in pairs:
            a = torch.zeros(fan_in, rank, dtype=dtype, device=dev)
            b = torch.zeros(rank, fan_out, dtype=dtype, device=dev)
            if p is not None:
                a[:, : p.rank] = p.a_t
                b[: p.rank] = p.b_t
            a_blocks.append(a)
            b_blocks.append(b)
        out[key] = Stacked(torch.cat(a_blocks, dim=1), torch.cat(b_blocks), rank)
    return out


@dataclass(frozen=True)
class LoraBatch:
    """The adapters of one step's rows (see the module docstring)."""

    stacks: dict[str, Stacked]
    count: int  # adapters in the mix
    onehot: torch.Tensor | None  # [rows, count, 1]; None: every row has the one adapter

    @classmethod
    def of(
        cls,
        adapters: Sequence[LoraAdapter | None],
        row_counts: Sequence[int],
        stacks: LoraStacks,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoraBatch | None:
        """The batch for requests with `adapters` (None: the base model) whose rows are
        `row_counts` consecutive rows each, in order; None when no request has one."""
        # The mix in digest order, whatever the rows' order: one cache entry per set.
        unique = {a.digest: a for a in adapters if a is not None}
        mix = [unique[d] for d in sorted(unique)]
        if not mix:
            return None
        index = {a.digest: i for i, a in enumerate(mix)}
        every_row = len(mix) == 1 and all(a is not None for a in adapters)
        onehot = None
        if not every_row:
            slots = [-1 if a is None else index[a.digest] for a in adapters]
            per_row = torch.tensor(slots, device=device).repeat_interleave(
                torch.tensor(list(row_counts), device=device)
            )
            onehot = torch.zeros(len(per_row), len(mix), 1, dtype=dtype, device=device)
            has = per_row >= 0
            onehot[has.nonzero().squeeze(1), per_row[has], 0] = 1
        return cls(stacks.get(mix), len(mix), onehot)

    def add(self, key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the rows' adapters' delta of projection `key` for input x ([rows, in])."""
        stacked = self.stacks.get(key)
        if stacked is None:
            return
        mid = torch.mm(x, stacked.a_t)
        if self.onehot is not None:
            rows = x.shape[0]
            mid = (mid.view(rows, self.count, stacked.rank) * self.onehot).view(rows, -1)
        y.addmm_(mid, stacked.b_t)
