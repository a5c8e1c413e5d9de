"""The packed bfloat16 product (`engine/weight_tiles.py`): every row count a pass takes
and more, shapes that do not fill a tile, both instructions (where this CPU has the dot
product), and the shapes it refuses."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest
import torch

from engine import weight_tiles
from engine.weight_tiles import PASS_ROWS, TILE, matmul, pack

BF16 = torch.bfloat16


def _bits(w: torch.Tensor) -> np.ndarray:
    return w.view(torch.int16).numpy().view(np.uint16)


def _weight(n_out: int, n_in: int, seed: int) -> torch.Tensor:
    return torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _exact(x: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    """The product of x rounded to bfloat16 (as `matmul` rounds it) and w, in float64."""
    return (x.to(BF16).double() @ w.double().T).numpy()


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    """A float32 sum of n_in products: a few units of rounding per term."""
    return float(1e-6 * x.shape[1] * x.abs().max() * w.float().abs().max() + 1e-6)


def test_pack_puts_each_output_row_in_its_tile_as_pairs_and_zero_pads() -> None:
    w = _weight(TILE + 5, 7, seed=0)
    tiles = pack(_bits(w))
    assert tiles.shape == (2, 4, 2 * TILE)  # 7 features: 4 pairs, the last half padding
    row = _bits(w)[TILE + 4]  # output row 36: tile 1, slot 4
    assert np.array_equal(tiles[1, :, 8:10].reshape(-1)[:7], row)
    assert not tiles[1, 3, 9] and not tiles[1, :, 10:].any()
    stacked = pack(np.stack([_bits(w), _bits(w)]))  # leading (layer) axes pass through
    assert stacked.shape == (2, 2, 4, 2 * TILE) and np.array_equal(stacked[1], tiles)


@pytest.mark.parametrize("rows", [*range(1, PASS_ROWS + 1), PASS_ROWS + 1, 2 * PASS_ROWS + 3])
@pytest.mark.parametrize(("n_out", "n_in"), [(37, 130), (2 * TILE, 1), (TILE - 1, 577)])
def test_product_is_the_float_product_of_bf16_operands(rows: int, n_out: int, n_in: int) -> None:
    w = _weight(n_out, n_in, seed=rows)
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(100 + rows))
    out = np.full((rows, n_out), np.nan, dtype=np.float32)
    matmul(pack(_bits(w)), x.numpy(), out)
    assert np.abs(out - _exact(x, w)).max() <= _tolerance(x, w)


def test_no_rows_is_no_work() -> None:
    out = np.empty((0, TILE), dtype=np.float32)
    matmul(pack(_bits(_weight(TILE, 8, seed=5))), np.empty((0, 8), dtype=np.float32), out)


def _fallback(rows: int) -> Any:
    """matmul's tile loop for `rows` rows with the float32 instructions, compiled here
    (the module compiles only the one its host runs)."""
    product = weight_tiles._tile_product(weight_tiles.Operands.BF16_WIDENED)

    @numba.njit(cache=False)
    def run(tiles: np.ndarray, x: np.ndarray, acc: np.ndarray) -> None:
        for t in range(tiles.shape[0]):
            product(tiles, t, x, 0, rows, acc[t])

    return run


@pytest.mark.parametrize("rows", [1, 5, PASS_ROWS])
def test_float32_fallback_gives_the_same_products(rows: int) -> None:
    w, n_in = _weight(3 * TILE, 130, seed=6), 130
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(7))
    xb = weight_tiles._as_bf16_pairs(x.numpy(), 65)
    acc = np.zeros((3, PASS_ROWS, TILE), dtype=np.float32)
    _fallback(rows)(pack(_bits(w)), xb, acc)
    got = acc[:, :rows].transpose(1, 0, 2).reshape(rows, 3 * TILE)
    assert np.abs(got - _exact(x, w)).max() <= _tolerance(x, w)


def test_a_non_finite_activation_stays_visible() -> None:
    w = _weight(TILE, 16, seed=3)
    x = np.ones((3, 16), dtype=np.float32)
    x[1, 5] = np.inf
    out = np.empty((3, TILE), dtype=np.float32)
    matmul(pack(_bits(w)), x, out)
    assert np.isfinite(out[[0, 2]]).all() and not np.isfinite(out[1]).any()


DISAGREE = [
    ((2, 9), (2, TILE), "features"),
    ((2, 6), (2, TILE), "features"),
    ((2, 8), (3, TILE), "out's shape"),
    ((2, 8), (2, TILE + 1), "out's shape"),
]


@pytest.mark.parametrize(("x_shape", "out_shape", "match"), DISAGREE)
def test_shapes_that_disagree_are_refused(
    x_shape: tuple[int, int], out_shape: tuple[int, int], match: str
) -> None:
    tiles = pack(_bits(_weight(TILE, 8, seed=4)))
    x = np.zeros(x_shape, dtype=np.float32)
    with pytest.raises(ValueError, match=match):
        matmul(tiles, x, np.zeros(out_shape, dtype=np.float32))
