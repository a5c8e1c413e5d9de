"""TorchAttention on a small paged cache, against plain causal attention: the prefill
path, and decode over an 8-bit cache.

The fused-kernel check records the inputs torch's SDPA receives: CPU SDPA takes its
flash kernel only for 4-D inputs and silently falls back to the math path (every score
materialised; a 4k-token prompt 2-3x slower) for 3-D ones, which no output would show.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import attention
from engine.attention import TorchAttention
from engine.kv_cache import KvCache, LayerKv
from engine.kv_layout import KvLayout
from tests.unit.engine.attention_meta import decode_meta, prefill_meta

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions start.. over keys 0..len(k)-1, by hand."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("context", [0, 6])  # a first chunk, and a later one
def test_prefill_chunk_matches_causal_attention_on_4d_inputs(
    monkeypatch: pytest.MonkeyPatch, context: int
) -> None:
    torch.manual_seed(0)
    qlen = 5
    seq_len = context + qlen
    nblocks = -(-seq_len // BLOCK)
    blocks = torch.tensor([3, 1, 0][:nblocks])  # scattered on purpose
    k_all = torch.randn(seq_len, KV_HEADS, HEAD_DIM)
    v_all = torch.randn(seq_len, KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    for pos in range(seq_len):
        k_cache[blocks[pos // BLOCK], pos % BLOCK] = k_all[pos]
        v_cache[blocks[pos // BLOCK], pos % BLOCK] = v_all[pos]
    meta = prefill_meta(qlen, seq_len, blocks)
    backend = TorchAttention()
    meta.plan = backend.plan(meta, BLOCK, torch.device("cpu"))
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(q.dim())
        return sdpa(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    q = torch.randn(qlen, HEADS, HEAD_DIM)
    out = backend.attend(q, LayerKv(torch.stack((k_cache, v_cache), 1)), meta)
    torch.testing.assert_close(out, _reference(q, k_all, v_all, context), atol=1e-5, rtol=1e-5)
    assert seen == [4], "prefill SDPA must get 4-D inputs (3-D takes the slow math path)"


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_decode_over_an_8bit_cache_matches_attention_over_its_dequantized_values(
    dtype: str, compute: torch.dtype
) -> None:
    """Scales applied to scores and probabilities, fp8 read as bits shifted into bfloat16
    (values times 2**-120, carried through the matmuls): the same answer as dequantizing
    first. Two sequences of different lengths share one decode group."""
    torch.manual_seed(0)
    layout = KvLayout(model_fingerprint="m", dtype=dtype, block_size=BLOCK, num_layers=1,
                      num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, memory_kind="cpu")  # fmt: skip
    cache = KvCache(layout, 6, torch.device("cpu"))
    lens, tables = [5, 7], [[1, 2], [4, 3]]
    slots = torch.tensor([tables[s][p // BLOCK] * BLOCK + p % BLOCK
                          for s, n in enumerate(lens) for p in range(n)])  # fmt: skip
    kv = (
        torch.randn(2, len(slots), KV_HEADS, HEAD_DIM)
        * torch.tensor([0.3, 4.0])[:, None, None, None]
    )
    cache.write(0, kv[0], kv[1], cache.plan_write(slots))
    meta = decode_meta(lens, tables)
    backend = TorchAttention()
    meta.plan = backend.plan(meta, BLOCK, torch.device("cpu"))
    q = torch.randn(2, HEADS, HEAD_DIM)
    out = backend.attend(q.to(compute), cache.layer(0), meta).float()
    for s, n in enumerate(lens):
        k, v = cache.layer(0).gather(torch.tensor(tables[s]), torch.float32)
        k, v = k.flatten(0, 1)[:n], v.flatten(0, 1)[:n]
        want = _reference(q[s : s + 1], k, v, n - 1)[0]
        tol = 1e-5 if compute == torch.float32 else 0.05
        torch.testing.assert_close(out[s], want, atol=tol, rtol=tol)


def _bf16_cache_with(lens: list[int], tables: list[list[int]]) -> tuple[KvCache, torch.Tensor]:
    """A two-layer bf16 pool whose layer 1 holds random K/V for sequences of `lens`
    tokens in blocks `tables` (layer 0 holds other values); returns it and the K/V
    ([2, tokens, kv_heads, head_dim], float32 of the stored bf16)."""
    layout = KvLayout(model_fingerprint="m", dtype="bfloat16", block_size=BLOCK, num_layers=2,
                      num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, memory_kind="cpu")  # fmt: skip
    cache = KvCache(layout, 8, torch.device("cpu"))
    slots = torch.tensor([tables[s][p // BLOCK] * BLOCK + p % BLOCK
                          for s, n in enumerate(lens) for p in range(n)])  # fmt: skip
    kv = torch.randn(2, len(slots), KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    plan = cache.plan_write(slots)
    cache.write(0, -kv[0], -kv[1], plan)
    cache.write(1, kv[0], kv[1], plan)
    return cache, kv.float()


def test_compiled_decode_reads_the_pool_in_place() -> None:
    """Decode rows over a bf16 cache through the compiled kernel: the attention of
    each row over its own blocks of the right layer (float32 inside, so within bf16's
    rounding of the output), for sequences of different lengths, one ending mid-block."""
    torch.manual_seed(1)
    lens, tables = [5, 11, 3], [[1, 6, 0], [4, 3, 7], [2, 0, 0]]
    cache, kv = _bf16_cache_with(lens, tables)
    meta = decode_meta(lens, tables)
    backend = TorchAttention(compiled_decode=True)
    meta.plan = backend.plan(meta, BLOCK, torch.device("cpu"))
    q = torch.randn(len(lens), HEADS, HEAD_DIM).to(torch.bfloat16)
    out = backend.attend(q, cache.layer(1), meta)
    assert meta.plan.bases is not None  # the compiled path ran
    start = 0
    for s, n in enumerate(lens):
        k, v = kv[0, start : start + n], kv[1, start : start + n]
        want = _reference(q[s : s + 1].float(), k, v, n - 1)[0]
        torch.testing.assert_close(out[s].float(), want, atol=0.02, rtol=0.02)
        start += n
    # The gathered path on the same inputs agrees to bf16's rounding.
    plain = TorchAttention()
    meta.plan = plain.plan(meta, BLOCK, torch.device("cpu"))
    torch.testing.assert_close(out, plain.attend(q, cache.layer(1), meta), atol=0.03, rtol=0.03)


def test_compiled_decode_refuses_blocks_outside_the_pool() -> None:
    lens, tables = [5], [[1, 9]]  # block 9 of a pool of 8
    cache, _ = _bf16_cache_with([5], [[1, 2]])
    meta = decode_meta(lens, tables)
    backend = TorchAttention(compiled_decode=True)
    meta.plan = backend.plan(meta, BLOCK, torch.device("cpu"))
    q = torch.randn(1, HEADS, HEAD_DIM).to(torch.bfloat16)
    with pytest.raises(IndexError, match="outside the KV pool"):
        backend.attend(q, cache.layer(1), meta)
