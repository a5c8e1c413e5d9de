"""The invariance probe's parts on small shapes: a fixed tile pads and trims without
changing values, and a row whose bits depend on its batch is counted (a product made
batch-dependent on purpose), while a row-wise one is not."""

from __future__ import annotations

import torch

from engine.linear_kernel import onednn_packs_bf16
from loadtest.engine.invariance_probe import differing_rows, product, tiled


def test_a_tiled_product_pads_trims_and_keeps_the_values() -> None:
    weight = torch.randn(8, 5)
    x = torch.randn(7, 5)
    run = tiled(product("torch", weight), 4)
    out = run(x)
    assert out.shape == (7, 8)
    torch.testing.assert_close(out, x @ weight.T)


def test_rows_that_depend_on_their_batch_are_counted() -> None:
    x = torch.randn(16, 4)
    row_wise = lambda rows: rows * 2.0  # noqa: E731
    assert differing_rows(row_wise, x, [2, 8], seed=0) == {2: 0, 8: 0}
    # Each row shifted by its batch's size: alone (size 1) it differs from any batch.
    batch_dependent = lambda rows: rows + rows.shape[0]  # noqa: E731
    assert differing_rows(batch_dependent, x, [2, 8], seed=0) == {2: 2, 8: 8}


def test_the_tiled_kernel_is_probed_in_float32_only_and_changes_no_row() -> None:
    from loadtest.engine.invariance_probe import kernels

    assert "tiled" in kernels(torch.float32) and "tiled" not in kernels(torch.bfloat16)
    assert ("onednn" in kernels(torch.bfloat16)) == onednn_packs_bf16()
    x = torch.randn(40, 96)
    run = product("tiled", torch.randn(70, 96))
    assert differing_rows(run, x, [2, 13, 40], seed=1) == {2: 0, 13: 0, 40: 0}
