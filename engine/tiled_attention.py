"""Causal prefill attention as tiles of bfloat16 matrix products, for the CPU.

Lifecycle: `TorchAttention._prefill` calls `tiled_causal_attention(q, k, v)` for each
bfloat16 prefill chunk of at least `MIN_QUERIES` tokens on the CPU, with the chunk's
queries and its sequence's gathered keys and values (the chunk's own last); nothing is
kept between calls.

Why not torch's SDPA: in bfloat16 its CPU flash kernel computes no faster than in
float32, and it was the largest part of a long bfloat16 prefill chunk's time. Here each
tile of a few dozen queries is one product against every key it may see (float32,
through oneDNN), a softmax and one bfloat16 product with the values (oneDNN), so the
attention's arithmetic runs in oneDNN's blocked products. Below `MIN_QUERIES` SDPA is
as fast or faster. Measurements: docs/engine.md "Kernels" (`loadtest/engine/roofline_bench`
measures the prefill it speeds up).

Tiles are sized so one key-value head's scores fit in about `SCORE_BUDGET` elements
(inside a core's L2; sized by the tile's first query, so up to 9% over, and `MIN_TILE`
overrides it past about 5,500 keys for groups of 3 query heads): larger tiles spill out
of L2 and lose to SDPA at long contexts. Each KV head is its own 2-D product so the key
and value slices stay contiguous (a batched product copied them every tile). oneDNN
builds a kernel per product shape on first sight; the step's layers all have the same
tiles, so every layer of a step after the first reuses each build.

Numerics, as SDPA's flash kernel's but for one order: float32 scores and softmax,
bfloat16 probabilities, products that sum in float32. It normalises the probabilities
before rounding them to bfloat16 (SDPA divides the output after), and stays within 1.5x
SDPA's mean distance from exact (`tests/unit/engine/test_tiled_attention.py` holds it;
what it measured: docs/engine.md "Kernels").

Why the scores' product is float32: a bfloat16 product rounds the scores themselves,
and at large scores that puts the output several times further from exact than SDPA,
for little speed. The float32 product goes through oneDNN's linear where torch has it,
which is faster than MKL's `torch.mm` at these shapes. (Nothing in pdserve lowers
torch's float32 matmul precision, which would let oneDNN run this product in
bfloat16.)
"""

from __future__ import annotations

import torch

#: Chunks shorter than this go to SDPA (as fast or faster on short chunks).
MIN_QUERIES = 128
#: Score elements per KV head and tile: 128 Ki float32 values, 512 KB.
SCORE_BUDGET = 1 << 17
#: Queries per tile, at most (larger tiles ran slower at every length measured) and at
#: least (fewer rows starve the product at very long contexts).
MAX_TILE = 64
MIN_TILE = 8


def tiled_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the last `T` of `L` positions, each seeing itself and those before.

    `q` is [T, heads, head_dim]; `k` and `v` are [L, kv_heads, head_dim] with L >= T (a
    later chunk of a chunked prefill sees L - T cached positions first). Query heads
    come in groups that share one KV head (GQA), `heads // kv_heads` each, in order.
    Returns [T, heads, head_dim] in q's dtype.
    """
    t, heads, hd = q.shape
    seq_len, kvh = k.shape[0], k.shape[1]
    if seq_len < t or heads % kvh:
        raise ValueError(f"need L >= T and heads % kv_heads == 0, got {q.shape}, {k.shape}")
    group = heads // kvh
    cached = seq_len - t
    # [kv_heads, T, group, head_dim]: a tile's queries of one KV head are contiguous
    # rows, query-major, so its output rows land in place.
    qs = (q.float() * hd**-0.5).view(t, kvh, group, hd).transpose(0, 1).contiguous()
    kh, vh = k.float().transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    out = torch.empty(kvh, t * group, hd, dtype=q.dtype, device=q.device)
    start = 0
    while start < t:
        n = _tile(group * (cached + start + 1), t - start)
        end = cached + start + n  # the tile's last query sees keys [0, end)
        future = _future(n, group, q.device)
        rows = slice(start * group, (start + n) * group)  # the tile's rows of `out`
        for h in range(kvh):
            scores = _scores(qs[h, start : start + n].view(n * group, hd), kh[h, :end])
            scores[:, cached + start : end].masked_fill_(future, float("-inf"))
            probs = torch.softmax(scores, -1).to(v.dtype)
            torch.mm(probs, vh[h, :end], out=out[h, rows])
        start += n
    return out.view(kvh, t, group, hd).transpose(0, 1).reshape(t, heads, hd)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q @ k.T in float32: through oneDNN's linear where torch has it, else MKL's."""
    if torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(q, k, None, "none", [], "")
        return out
    return q @ k.t()


def _tile(per_query: int, left: int) -> int:
    """Queries in the next tile, given each query's score elements (its group's rows
    times the keys it sees): as many as fit the score budget, within the bounds."""
    return min(left, max(MIN_TILE, min(MAX_TILE, SCORE_BUDGET // per_query)))


def _future(n: int, group: int, device: torch.device) -> torch.Tensor:
    """[n * group, n] bool: which of the tile's own positions each query row must not
    see (the later ones), its rows query-major as the tile's scores."""
    upper = torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
    return upper.repeat_interleave(group, 0)
