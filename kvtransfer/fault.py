"""A fault hook for tests: flip bits in KV as it arrives, to prove the checksums catch it.

Set `PDSERVE_TEST_KV_BIT_FLIPS=N` in a decode worker's environment (or pass a `BitFlips`
to `KvImporter`) and the importer flips one random bit of one block it just read on every
Nth read, re-reads included; `N=1` corrupts every read, so the import fails for good
(KvCorruptionError), `N=2` only the first read of each import, so its retry succeeds.
Never for production: it exists so tests on real processes can corrupt bytes after the
transport has delivered them, where a real fault would.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ENV = "PDSERVE_TEST_KV_BIT_FLIPS"


@dataclass
class BitFlips:
    """Flip one bit in every `every`th read (0: never). Counters are thread-safe."""

    every: int = 0
    seed: int = 0
    reads: int = 0
    flipped: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"{ENV}: must be >= 0, got {self.every}")
        self._rng = random.Random(self.seed)

    @classmethod
    def from_env(cls) -> BitFlips:
        raw = os.environ.get(ENV, "0")
        try:
            return cls(every=int(raw))
        except ValueError as exc:
            raise ValueError(f"{ENV}: expected a whole number, got {raw!r}") from exc

    def after_read(self, kv_blocks: torch.Tensor, block_ids: Sequence[int]) -> int | None:
        """Maybe corrupt one of `block_ids` (just read into `kv_blocks`); returns the index
        into `block_ids` of the block flipped, or None."""
        if not self.every or not block_ids:
            return None
        with self._lock:
            self.reads += 1
            if self.reads % self.every:
                return None
            index = self._rng.randrange(len(block_ids))
            byte = self._rng.randrange(kv_blocks.shape[1])
            bit = self._rng.randrange(8)
            self.flipped += 1
        row = kv_blocks[block_ids[index]]
        row[byte] = int(row[byte]) ^ (1 << bit)
        return index
