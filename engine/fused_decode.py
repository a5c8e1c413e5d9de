"""The fused decode: which steps run as one compiled kernel, and what it reads.

Lifecycle: at engine start `fused_decode_wanted(config's DecodeKernel, ...)` decides once
whether this engine may fuse (and refuses `fused` where it cannot run); `LlamaModel`
then builds one `FusedDecoder` from the weights it loads, which compiles the kernel
(`engine/decode_kernel.py`) and lives as long as the model. Each step, `ModelRunner`
hands it the step when every request in it decodes (one token, or its last token and
the drafts it verifies) and the step has at most `MAX_ROWS` rows
(`FusedDecoder.rows_of`); `decode` writes the rows' K/V into the pool and returns their
logits. Every other step runs the torch forward on the same pool, so a sequence moves
between the two from step to step.

The kernel takes bfloat16 weights and a bfloat16, int8 or fp8 e4m3 cache on the CPU
(`decode_kernel.decode_step`, `decode_step_8bit`), and rows with a LoRA adapter
(`engine/fused_lora.py`: each row pays for its own adapter only); prefill chunks and
prompt scoring stay on the torch path. A verification's rows
are positions of one sequence, run in order within each layer, so the kernel's causal
attention needs nothing more than a decode row's; and since a row's arithmetic is its
own (the products take each row alone, `engine.weight_tiles`), a verified position's
logits carry the bits a plain decode step gives it: speculation on or off, greedy and
seeded output is the same in bfloat16 as long as the steps fuse (see the kernel's
docstring for why it exists and what it costs). Where an engine fuses, the torch
forward's larger decode steps also attend through the kernel's attention
(`TorchAttention(compiled_decode=True)`).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import DecodeKernel
from engine.fused_lora import PackedAdapters
from engine.kv_cache import KvCache
from engine.kv_layout import KvLayout
from engine.precision import WeightQuant

if TYPE_CHECKING:
    from engine.lora import LoraAdapter
    from engine.request import Request

log = logging.getLogger(__name__)

#: Most rows a fused step takes. Its products stream the weights once per step and,
#: where the CPU has AVX-512 BF16, use its dot products (`engine.weight_tiles`), so the
#: fused step beat the torch forward at every decode batch size measured up to this
#: one; larger steps were not measured, and run through torch. Measurements:
#: docs/engine.md "Kernels" ("Why up to 128 rows").
MAX_ROWS = 128
#: Most rows on a CPU without AVX-512 BF16, where the tiles multiply in float32 FMAs:
#: that path was not measured against torch on such a CPU (on AVX2 its 512-bit vectors
#: split in two, and the accumulators no longer fit the registers), so it keeps the
#: bound the float32 products had before the tiles.
FALLBACK_MAX_ROWS = 4
#: The 8-bit caches the kernel reads and writes, besides an unquantized bfloat16 one.
QUANTIZED_KV = (torch.int8, torch.float8_e4m3fn)


def max_rows() -> int:
    """Most rows a fused step takes on this CPU (imports numba)."""
    from engine import weight_tiles

    return MAX_ROWS if weight_tiles.BF16_DOT else min(MAX_ROWS, FALLBACK_MAX_ROWS)


def fused_decode_wanted(
    kernel: DecodeKernel,
    device: torch.device,
    dtype: torch.dtype,
    quant: WeightQuant,
    kv_dtype: torch.dtype,
) -> bool:
    """Whether this engine builds the fused decode; `fused` where it cannot run raises
    ValueError naming what is missing."""
    if kernel is DecodeKernel.TORCH:
        return False
    missing = [
        what
        for what, ok in (
            (f"device cpu (got {device.type})", device.type == "cpu"),
            (f"dtype bfloat16 (got {dtype})", dtype == torch.bfloat16),
            (f"quantization none (got {quant})", quant is WeightQuant.NONE),
            (
                f"kv_cache_dtype auto, int8 or fp8 (stores {kv_dtype})",
                kv_dtype == dtype or kv_dtype in QUANTIZED_KV,
            ),
        )
        if not ok
    ]
    if kernel is DecodeKernel.FUSED:
        if missing:
            raise ValueError("decode_kernel fused needs " + ", ".join(missing))
        return True
    # "auto" fuses only on x86, where the kernel was measured against oneDNN.
    return not missing and platform.machine().lower() in ("x86_64", "amd64")


@dataclass
class FusedStep:
    """A step the kernel runs: `rows` are the plain decodes' rows, one per request of
    `sampling` in its order, then each of `speculating`'s last token and drafts (1 + k
    rows, positions in order): the row order of the runner's `StepResult`."""

    rows: list[DecodeRow]
    sampling: list[Request]
    speculating: list[Request]


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a fused step: the token it computes, that token's position, the
    sequence's block ids (the position's slot among them) and its LoRA adapter (None:
    the base model)."""

    token: int
    position: int
    blocks: list[int]
    adapter: LoraAdapter | None = None


def _bits(t: torch.Tensor) -> np.ndarray:
    """A bfloat16 tensor's bits as a uint16 numpy array sharing its memory."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


class FusedDecoder:
    """The model's weights as the kernel reads them, and the call that runs a step.

    Holds its own bfloat16 copy of the layers' projections and the LM head, packed in
    the kernel's tiles (`engine.weight_tiles.pack`, stacked per kind over layers,
    padded to whole tiles): the torch path keeps only oneDNN's packed copies, which the
    kernel cannot read. The LM head is copied even where it is tied to the embedding.
    What that costs the default model: docs/engine.md "Kernels".
    """

    def __init__(
        self,
        projections: dict[str, torch.Tensor],
        weights: dict[str, torch.Tensor],
        dims: tuple[int, int, int, int],
        rope: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        kv_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """`projections` and `weights` as `LlamaModel` loads them (bfloat16); `dims` the
        model's (layers, heads, kv_heads, head_dim); `rope` its float32 cos and sin
        tables ([positions, head_dim]); `kv_dtype` what the KV cache stores (bfloat16,
        int8 or float8_e4m3fn). Compiles the kernel (or loads it from numba's disk
        cache); raises if numba cannot."""
        from engine import decode_kernel  # numba: loaded only where the engine fuses
        from engine.kv_quant_kernel import FP8, INT8
        from engine.weight_tiles import pack

        self.kv_dtype = kv_dtype
        self._kind = {torch.int8: INT8, torch.float8_e4m3fn: FP8}.get(kv_dtype)
        if self._kind is None and kv_dtype != torch.bfloat16:
            raise ValueError(f"the fused decode stores no KV as {kv_dtype}")
        self._kernel = (
            decode_kernel.decode_step(*dims[1:])
            if self._kind is None
            else decode_kernel.decode_step_8bit(*dims[1:], self._kind)
        )
        self.max_rows = max_rows()
        layers = range(dims[0])

        def stack(key: str) -> np.ndarray:
            return pack(_bits(torch.stack([projections[f"{i}.{key}"] for i in layers])))

        def biases(key: str) -> np.ndarray:
            """float32 [layers, out]: the projection's biases, zeros where it has none."""
            zeros = torch.zeros(projections[f"0.{key}"].shape[0])
            return torch.stack([weights.get(f"{i}.{key}_b", zeros).float() for i in layers]).numpy()

        self.weights = (
            stack("qkv"),
            biases("qkv"),
            stack("o"),
            biases("o"),
            stack("gate_up"),
            biases("gate_up"),
            stack("down"),
            biases("down"),
            _bits(torch.stack([weights[f"{i}.in_norm"] for i in layers])),
            _bits(torch.stack([weights[f"{i}.post_norm"] for i in layers])),
            _bits(weights["norm"]),
            pack(_bits(projections["lm_head"])),
        )
        self.vocab_size = int(projections["lm_head"].shape[0])
        self.heads = dims[1:]
        self.cos, self.sin = (t.float().contiguous().numpy() for t in rope)
        self.eps = eps
        self._embed = weights["embed"]
        self.adapters = PackedAdapters(dims[0])
        self._warm_up()

    def rows_of(
        self, items: list[tuple[Request, int]], num_blocks: int, block_size: int
    ) -> FusedStep | None:
        """The step as fused rows, or None where it must run through torch: more than
        `max_rows` rows, a row that is not one plain token or one verification (a
        prefill chunk), or prompt log-probabilities still to score. A
        row the kernel could not run safely (see `_in_bounds`) goes to torch too, which
        raises on it as it would without the kernel."""
        plain: list[DecodeRow] = []
        drafted: list[DecodeRow] = []
        step = FusedStep([], [], [])
        for req, n in items:
            rows = self._rows_of(req, n)
            if rows is None or not all(self._in_bounds(r, num_blocks, block_size) for r in rows):
                return None
            if req.draft_token_ids:
                drafted += rows
                step.speculating.append(req)
            else:
                plain += rows
                step.sampling.append(req)
        step.rows = plain + drafted
        return step if 0 < len(step.rows) <= self.max_rows else None

    @staticmethod
    def _rows_of(req: Request, n: int) -> list[DecodeRow] | None:
        """`req`'s rows this step: its last token, then its drafts in order (their rows
        run in that order within each layer, so each draft attends over the K/V the row
        before it wrote); None for a chunk the kernel does not run."""
        start = req.num_computed_tokens
        last = start + 1 == req.num_tokens and n == 1 + len(req.draft_token_ids)
        scoring = req.sampling.prompt_logprobs is not None and start < req.num_prompt_tokens
        if not last or scoring:
            return None
        return [
            DecodeRow(req.token_at(p), p, req.block_ids, req.lora) for p in range(start, start + n)
        ]

    def _in_bounds(self, row: DecodeRow, num_blocks: int, block_size: int) -> bool:
        """Whether the kernel, which has no bounds checks, stays inside its arrays for
        `row`: block ids within the pool, blocks covering every position up to the
        token's, and the position within the rotary tables."""
        blocks = row.blocks
        return (
            0 <= row.position < len(self.cos)
            and row.position // block_size < len(blocks)
            and min(blocks) >= 0
            and max(blocks) < num_blocks
        )

    def decode(self, rows: list[DecodeRow], cache: KvCache) -> torch.Tensor:
        """One step of `rows` on `cache` (its pool stores this decoder's `kv_dtype`):
        writes each row's K/V at its position's slot and returns float32 logits [rows,
        vocab]. Raises IndexError for a row `rows_of` would not have let through
        (nothing is written then)."""
        pool, block_size = cache.blocks, cache.layout.block_size
        num_blocks = pool.shape[0]
        if not all(self._in_bounds(r, num_blocks, block_size) for r in rows):
            raise IndexError("fused decode row outside the KV pool or the rotary table")
        tables = np.zeros((len(rows), max(len(r.blocks) for r in rows)), dtype=np.int32)
        for i, r in enumerate(rows):
            tables[i, : len(r.blocks)] = r.blocks
        ids = torch.tensor([r.token for r in rows])
        x = self._embed.index_select(0, ids).float().numpy()
        positions = np.array([r.position for r in rows], dtype=np.int64)
        logits = np.empty((len(rows), self.vocab_size), dtype=np.float32)
        lora = self.adapters.operands([r.adapter for r in rows])
        if self._kind is None:
            flat = pool.view(-1).view(torch.int16).numpy().view(np.uint16)
            block_elems = pool.shape[1] // 2  # bfloat16 elements
            self._kernel(x, positions, tables, self.weights, self.cos, self.sin, flat,
                         block_size, block_elems, self.eps, lora, logits)  # fmt: skip
            return torch.from_numpy(logits)
        writer = cache.quant_writer
        if writer is None or cache.layout.torch_dtype != self.kv_dtype:
            raise ValueError(f"the fused decode needs a compiled {self.kv_dtype} KV cache")
        # A block a row starts belonged to its previous owner, scales included: zeroed
        # first, as a torch step's write plan does.
        fresh = [r.blocks[r.position // block_size] for r in rows if r.position % block_size == 0]
        if fresh:
            pool.index_fill_(0, torch.tensor(fresh), 0)
        self._kernel(x, positions, tables, self.weights, self.cos, self.sin, writer.pool,
                     writer.scales, block_size, self.eps, writer.constants, lora,
                     logits)  # fmt: skip
        return torch.from_numpy(logits)

    def _warm_up(self) -> None:
        """One step on a scratch cache of one block, so the kernel compiles (or loads)
        now and not inside the first request's step."""
        _, kv_heads, head_dim = self.heads
        layers = self.weights[0].shape[0]
        layout = KvLayout("warm-up", str(self.kv_dtype).removeprefix("torch."), 8, layers,
                          kv_heads, head_dim, "cpu")  # fmt: skip
        self.decode([DecodeRow(0, 0, [0])], KvCache(layout, 1, torch.device("cpu")))
