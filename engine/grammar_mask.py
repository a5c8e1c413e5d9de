"""Token masks of a step's constrained rows, computed off the step thread.

Lifecycle: `OutputStage` makes a `MaskJob(grammars, vocab_size)` for each step with a
constrained row, before the model runs; llguidance fills the masks on its own thread
pool (it drops the GIL) while the model computes, and `allowed(n, index)` then waits for
them and returns the [n, vocab] bool tensor the sampler applies. A step with no
constrained row starts no job. The grammars themselves are `engine.grammar`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import torch

from engine.grammar import Grammar

#: Bits in one word of llguidance's token bitmask.
WORD_BITS = 32
_BIT = torch.arange(WORD_BITS, dtype=torch.int32)


class MaskJob:
    """The next-token masks of one step's constrained rows, computed off the step thread."""

    # Made on the first constrained step, not at import: every worker imports this
    # module, most never constrain a request.
    _pool: ThreadPoolExecutor | None = None
    _executor: llguidance.LLExecutor | None = None

    @classmethod
    def _workers(cls) -> tuple[ThreadPoolExecutor, llguidance.LLExecutor]:
        if cls._pool is None or cls._executor is None:
            cls._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            cls._executor = llguidance.LLExecutor()
        return cls._pool, cls._executor

    def __init__(self, grammars: Sequence[Grammar], vocab_size: int) -> None:
        self.count = len(grammars)
        self.vocab_size = vocab_size
        words = (vocab_size + WORD_BITS - 1) // WORD_BITS
        self._bits = torch.full((self.count, words), -1, dtype=torch.int32)
        pairs = [(g.matcher, i) for i, g in enumerate(grammars)]
        pool, executor = self._workers()
        # Filled through a numpy view of the same memory: llguidance's torch module
        # defines a torch.compile'd function, and importing it loads torch._dynamo (0.8 s
        # at every gateway and worker start).
        self._done: Future[None] = pool.submit(
            llguidance.numpy.fill_next_token_bitmask_par, executor, pairs, self._bits.numpy()
        )

    def allowed(self, rows: int, index: Sequence[int]) -> torch.Tensor:
        """[rows, vocab] bool: the constrained rows' masks at `index` (job row i goes to
        row index[i]); every other row allows everything."""
        self._done.result()
        out = torch.ones(rows, self.vocab_size, dtype=torch.bool)
        if self.count:
            bits = (self._bits[:, :, None] >> _BIT) & 1
            out[torch.tensor(list(index))] = bits.reshape(self.count, -1)[:, : self.vocab_size] > 0
        return out
