"""The float32 tiles (`engine.weight_tiles.pack_f32`, `matmul_f32`): each row's bits do
not depend on the rows beside it, how many there are, or how the tiles are split over
threads; the product is float32's; bad shapes are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.weight_tiles import PASS_ROWS, TILE, matmul_f32, pack_f32


def _product(tiles: np.ndarray, x: np.ndarray, n_out: int, t0: int = 0, t1: int = -1) -> np.ndarray:
    out = np.full((x.shape[0], n_out), np.nan, dtype=np.float32)
    matmul_f32(tiles, x.view(np.uint16), out, t0, tiles.shape[0] if t1 < 0 else t1)
    return out


def _operands(n_out: int, n_in: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_out, n_in)) * 0.1).astype(np.float32)
    return w, rng.standard_normal((rows, n_in)).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    n_out=st.integers(1, 3 * TILE + 5),
    n_in=st.integers(1, 200),
    rows=st.integers(1, 3 * PASS_ROWS + 2),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_a_row_has_the_same_bits_in_any_batch(
    n_out: int, n_in: int, rows: int, seed: int, data: st.DataObject
) -> None:
    w, x = _operands(n_out, n_in, rows, seed)
    tiles = pack_f32(w)
    together = _product(tiles, x, n_out)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 1e-6 * n_in * np.abs(x).max() * np.abs(w).max() + 1e-6
    assert np.abs(together - exact).max() <= bound
    pick = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows))
    subset = _product(tiles, np.ascontiguousarray(x[pick]), n_out)
    assert np.array_equal(subset, together[pick])  # any rows, any count, any order
    for r in range(0, rows, max(rows // 3, 1)):
        assert np.array_equal(_product(tiles, x[r : r + 1].copy(), n_out)[0], together[r])


def test_tile_ranges_written_by_separate_calls_give_the_same_bits() -> None:
    w, x = _operands(5 * TILE + 3, 70, 17, seed=1)
    tiles = pack_f32(w)
    whole = _product(tiles, x, w.shape[0])
    parts = np.full_like(whole, np.nan)
    for t0, t1 in ((0, 2), (2, 3), (3, 6)):
        matmul_f32(tiles, x.view(np.uint16), parts, t0, t1)
    assert np.array_equal(parts, whole)


def test_pack_f32_puts_each_output_in_its_tile_and_zero_pads() -> None:
    w, _ = _operands(TILE + 5, 7, 1, seed=2)
    tiles = pack_f32(w)
    assert tiles.dtype == np.uint16 and tiles.shape == (2, 7, 2 * TILE)
    as_f32 = tiles.view(np.float32)
    assert np.array_equal(as_f32[1, :, 4], w[TILE + 4])
    assert not as_f32[1, :, 5:].any()


def test_a_non_finite_activation_stays_in_its_row() -> None:
    w, x = _operands(TILE, 16, 3, seed=3)
    x[1, 5] = np.inf
    out = _product(pack_f32(w), x, TILE)
    assert np.isfinite(out[[0, 2]]).all() and not np.isfinite(out[1]).all()


@pytest.mark.parametrize(
    ("x_shape", "out_shape", "t1", "match"),
    [
        ((2, 9), (2, TILE), 1, "features"),
        ((2, 8), (3, TILE), 1, "out's shape"),
        ((2, 8), (2, TILE + 1), 1, "out's shape"),
        ((2, 8), (2, TILE), 2, "tile range"),
    ],
)
def test_shapes_that_disagree_are_refused(
    x_shape: tuple[int, int], out_shape: tuple[int, int], t1: int, match: str
) -> None:
    tiles = pack_f32(np.ones((TILE, 8), dtype=np.float32))
    x = np.zeros(x_shape, dtype=np.float32).view(np.uint16)
    with pytest.raises(ValueError, match=match):
        matmul_f32(tiles, x, np.zeros(out_shape, dtype=np.float32), 0, t1)
