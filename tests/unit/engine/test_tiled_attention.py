"""Tiled bfloat16 prefill attention against causal attention in float64, and which
prefill chunks `TorchAttention` sends to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import attention, tiled_attention
from engine.attention import TorchAttention
from engine.kv_cache import LayerKv
from engine.tiled_attention import MIN_QUERIES, tiled_causal_attention
from tests.unit.engine.attention_meta import prefill_meta

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's: three query heads per KV head


def _inputs(qlen: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # Scaled so that scores reach ~+-20, where bfloat16 rounding of them shows.
    q = torch.randn(qlen, HEADS, HEAD_DIM, generator=g) * 2
    k = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=g) * 2
    v = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention in float64 of the inputs' bfloat16 values, by hand."""
    group = HEADS // KV_HEADS
    q, k, v = q.double(), k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    allowed = torch.arange(k.shape[0])[None, :] <= qpos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=allowed,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("qlen", "seq_len"),
    [(128, 128), (200, 200), (130, 900), (96, 3000)],  # first chunks; later ones, long ones
)
def test_tiled_attention_is_as_near_exact_as_sdpa_in_bfloat16(qlen: int, seq_len: int) -> None:
    """Within 1.5x SDPA's mean distance from exact (1.24-1.30x measured: it normalises
    the probabilities before rounding them to bfloat16, SDPA after the product). Scores
    rounded to bfloat16 measured 3-7x here; a wrong mask or tile edge is off by ~0.1-1."""
    q, k, v = _inputs(qlen, seq_len)
    exact = _exact(q, k, v)
    tiled = tiled_causal_attention(q, k, v)
    assert tiled.shape == q.shape and tiled.dtype == torch.bfloat16
    ours = (tiled.double() - exact).abs().mean().item()
    sdpa = (_sdpa(q, k, v).double() - exact).abs().mean().item()
    assert ours <= 1.5 * sdpa, (ours, sdpa)


def test_many_small_tiles_match_one_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tile edges in every position: a tiny budget gives minimum-size tiles. Within
    bfloat16's rounding of the same sums in another order; a mask or offset wrong at
    one edge is off by ~0.1-1."""
    q, k, v = _inputs(100, 160)
    whole = tiled_causal_attention(q, k, v)
    monkeypatch.setattr(tiled_attention, "SCORE_BUDGET", 1)
    tiles = tiled_causal_attention(q, k, v)
    torch.testing.assert_close(tiles, whole, atol=2e-2, rtol=2e-2)
    assert (tiles.double() - _exact(q, k, v)).abs().max().item() < 2e-2


@pytest.mark.parametrize("cached", [0, 40])  # a first chunk, and a later one
def test_no_query_sees_a_later_position(cached: int) -> None:
    """Changing position p's K/V leaves every query before p bit-identical and changes
    the query at p itself (it sees its own position)."""
    q, k, v = _inputs(128, cached + 128)
    p = cached + 100
    before = tiled_causal_attention(q, k, v)
    k[p:], v[p:] = 5.0, -5.0
    after = tiled_causal_attention(q, k, v)
    assert torch.equal(after[:100], before[:100])
    assert not torch.equal(after[100], before[100])


def test_without_onednn_the_scores_come_from_torch_mm() -> None:
    q, k, v = _inputs(130, 300)
    with_onednn = tiled_causal_attention(q, k, v)
    with torch.backends.mkldnn.flags(enabled=False):
        without = tiled_causal_attention(q, k, v)
    torch.testing.assert_close(without, with_onednn, atol=2e-2, rtol=2e-2)


def test_shapes_it_cannot_attend_are_refused() -> None:
    q, k, v = _inputs(128, 128)
    with pytest.raises(ValueError, match="L >= T"):
        tiled_causal_attention(q, k[:32], v[:32])
    with pytest.raises(ValueError, match="kv_heads"):
        tiled_causal_attention(q[:, :8], k, v)


@pytest.mark.parametrize(
    ("dtype", "qlen", "tiled"),
    [
        (torch.bfloat16, MIN_QUERIES, True),
        (torch.bfloat16, MIN_QUERIES - 1, False),  # short chunks: SDPA is as fast
        (torch.float32, 2 * MIN_QUERIES, False),  # float32 keeps transformers' kernel
    ],
)
def test_torch_backend_tiles_long_bfloat16_chunks_only(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, qlen: int, tiled: bool
) -> None:
    block, context = 16, 20  # a later chunk, over a partly filled first block
    seq_len = context + qlen
    nblocks = -(-seq_len // block)
    q, k, v = (t.to(dtype) for t in _inputs(qlen, seq_len))
    pool = torch.zeros(nblocks + 1, 2, block, KV_HEADS, HEAD_DIM, dtype=dtype)
    blocks = torch.arange(nblocks, 0, -1)  # reversed, so order matters
    for pos in range(seq_len):
        pool[blocks[pos // block], 0, pos % block] = k[pos]
        pool[blocks[pos // block], 1, pos % block] = v[pos]
    meta = prefill_meta(qlen, seq_len, blocks)
    backend = TorchAttention()
    meta.plan = backend.plan(meta, block, torch.device("cpu"))
    calls: list[int] = []

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return tiled_causal_attention(*args)

    monkeypatch.setattr(attention, "tiled_causal_attention", counted)
    out = backend.attend(q, LayerKv(pool), meta)
    assert len(calls) == int(tiled)
    exact = _exact(q, k, v)
    assert (out.double() - exact).abs().max().item() < 0.05
