"""What two engines must agree on to share KV blocks byte for byte, and the pool's memory.

Lifecycle: at engine start `KvLayout.from_spec` describes one block (every layer's K and
V for `block_size` tokens, plus an 8-bit cache's scales), `blocks_for_budget` turns the
memory budget into a block count and `allocate_blocks` makes the zeroed pool that
`engine.kv_cache.KvCache` then addresses. Peers compare `KvLayout.fingerprint()` at the
KV-transfer handshake and refuse a mismatch; the registry refuses a worker whose
fingerprint differs from the live workers' (they share prefix-cache hits).

The fingerprint covers the numerics as well as the bytes' shape: two engines whose
blocks have the same shape but whose arithmetic differs (the compute dtype under an
8-bit cache, the linear, decode and attention kernels) compute different bits for the
same prompt, so a block one computed is not the block the other would have: imported
or matched, it would make a request's tokens depend on where it ran.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import xxhash

from engine.model_spec import ModelSpec

#: Bumped when the pool's tensor layout changes; part of the layout fingerprint.
#: 1: layer-major [layers, K/V, blocks, ...]; 2: block-major with in-block scales;
#: 3: the numerics (compute dtype, kernels) are part of the fingerprint.
KV_LAYOUT_VERSION = 3
_MADV_HUGEPAGE = 14
SCALE_BYTES = 4  # float32

#: Largest magnitude each 8-bit format stores (int8 symmetric; e4m3fn's finite max).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True)
class KvLayout:
    """Everything that must match for two engines to share KV blocks byte for byte."""

    model_fingerprint: str
    dtype: str  # the stored dtype: the compute dtype, int8 or float8_e4m3fn
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    memory_kind: str  # "cpu" or "cuda"
    compute_dtype: str = ""  # the dtype the model computes in ("": the stored dtype)
    kernels: str = ""  # the kernel family that computes the blocks (`kernel_family`)

    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec,
        dtype: torch.dtype,
        block_size: int,
        device: torch.device,
        *,
        compute_dtype: torch.dtype | None = None,
        kernels: str = "",
    ) -> KvLayout:
        """`dtype` is the stored one; `compute_dtype` defaults to it (an unquantized
        cache); `kernels` names the engine's kernels (tools that only move bytes leave
        it empty)."""
        return cls(
            model_fingerprint=spec.fingerprint,
            dtype=_name(dtype),
            block_size=block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            memory_kind=device.type,
            compute_dtype=_name(compute_dtype or dtype),
            kernels=kernels,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def quantized(self) -> bool:
        return self.torch_dtype in QMAX

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """One token's K (or V) in one layer: the unit the pool is addressed in."""
        return self.num_kv_heads * self.head_dim * self.element_size

    @property
    def data_rows(self) -> int:
        """Rows of K/V data in a block: every layer, K then V, `block_size` tokens each."""
        return self.num_layers * 2 * self.block_size

    @property
    def scale_bytes(self) -> int:
        """The block's scales (8-bit caches only): one per layer, K/V and KV head."""
        return self.num_layers * 2 * self.num_kv_heads * SCALE_BYTES if self.quantized else 0

    @property
    def rows_per_block(self) -> int:
        """Data rows plus the rows the scales occupy, rounded up to whole rows."""
        return self.data_rows + -(-self.scale_bytes // self.row_bytes)

    @property
    def bytes_per_block(self) -> int:
        return self.rows_per_block * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers, scales included (rounded down)."""
        return self.bytes_per_block // self.block_size

    def fingerprint(self) -> str:
        """Stable id of this layout: peers compare it at handshake and refuse a mismatch."""
        text = (
            f"v{KV_LAYOUT_VERSION}|{self.model_fingerprint}|{self.dtype}|{self.block_size}|"
            f"{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|{self.memory_kind}|"
            f"{self.compute_dtype}|{self.kernels}"
        )
        return xxhash.xxh3_64_hexdigest(text.encode())

    def describe(self) -> str:
        """The fields a person compares when two layouts differ (the model by its
        fingerprint)."""
        return (
            f"model {self.model_fingerprint}, KV {self.dtype} in blocks of {self.block_size} "
            f"on {self.memory_kind}, computed in {self.compute_dtype or self.dtype}"
            f" by {self.kernels or 'unnamed kernels'}"
        )


def kernel_family(linear: str, fused_rows: int, attention: str) -> str:
    """The kernels that decide a block's bits: the linear kernel's name, the fused
    decode's row limit (0: every step through torch; the limit decides which steps it
    takes), the attention backend's name."""
    decode = f"fused<={fused_rows}" if fused_rows else "torch"
    return f"linear={linear} decode={decode} attention={attention}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def blocks_for_budget(layout: KvLayout, budget_bytes: int) -> int:
    """How many blocks fit in the budget; at least one, or a clear error."""
    n = budget_bytes // layout.bytes_per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_bytes={budget_bytes} is below one block ({layout.bytes_per_block} bytes)"
        )
    return n


def allocate_blocks(layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """A zeroed [num_blocks, bytes_per_block] byte pool (huge pages asked for on CPU)."""
    if layout.row_bytes % SCALE_BYTES:
        raise ValueError(f"KV rows of {layout.row_bytes} bytes cannot hold aligned scales")
    pool = torch.empty(num_blocks, layout.bytes_per_block, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        _advise_huge_pages(pool)
    # Zeroed, not left empty: padding slots read by batched attention must hold finite
    # values, and touching every page now keeps page faults out of the first transfers.
    return pool.zero_()


def _advise_huge_pages(pool: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages before first touch (best effort).

    Bulk KV copies between processes (NIXL over CMA) run faster from huge-page-backed
    pools: fewer TLB misses and page walks (docs/engine.md "Kernels").
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    page = 4096
    start = -(-pool.data_ptr() // page) * page
    end = (pool.data_ptr() + pool.numel()) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
