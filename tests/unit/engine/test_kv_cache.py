"""KvCache on a small synthetic layout: the block-major pool, its views and 8-bit storage.

One class under test, so the layout is built by hand (no model); the engine-level
parity and accuracy of each cache dtype are tested in test_engine_parity and
test_accuracy_gate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention import select_backend
from engine.config import EngineConfig
from engine.kv_cache import KvCache, _as_dtype
from engine.kv_layout import KV_LAYOUT_VERSION, KvLayout, blocks_for_budget
from engine.precision import KvCacheDType

CPU = torch.device("cpu")
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 4
EIGHT_BIT = ["int8", "float8_e4m3fn"]


def _layout(dtype: str = "float32", **over: object) -> KvLayout:
    fields = dict(model_fingerprint="m", dtype=dtype, block_size=BLOCK, num_layers=LAYERS,
                  num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, memory_kind="cpu")  # fmt: skip
    fields.update(over)
    return KvLayout(**fields)  # type: ignore[arg-type]


def _slots(blocks: list[int], offsets: list[int]) -> torch.Tensor:
    return torch.tensor([b * BLOCK + o for b, o in zip(blocks, offsets, strict=True)])


def test_a_block_is_one_contiguous_row_and_layer_views_alias_it() -> None:
    layout = _layout()
    cache = KvCache(layout, 5, CPU)
    assert cache.blocks.shape == (5, layout.bytes_per_block) and cache.blocks.is_contiguous()
    assert layout.bytes_per_block == LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
    k, v = torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM)
    cache.write(1, k, v, cache.plan_write(_slots([3, 3], [1, 2])))
    view = cache.layer(1)
    torch.testing.assert_close(view.k[3, 1:3], k, rtol=0, atol=0)
    torch.testing.assert_close(view.v[3, 1:3], v, rtol=0, atol=0)
    # Nothing outside block 3 changed: the write stayed inside that block's row.
    others = torch.cat([cache.blocks[:3], cache.blocks[4:]])
    assert int(others.count_nonzero()) == 0
    # What the flash kernel needs: head_dim contiguous, page stride = one whole block.
    assert view.k.stride(-1) == 1
    assert view.k.stride(0) * view.k.element_size() == layout.bytes_per_block
    copy = KvCache(layout, 5, CPU)
    copy.blocks[0] = cache.blocks[3]  # what a transfer does: whole rows
    torch.testing.assert_close(copy.layer(1).k[0, 1:3], k, rtol=0, atol=0)


def test_layout_version_dtype_and_fields_are_in_the_fingerprint() -> None:
    base = _layout()
    assert KV_LAYOUT_VERSION == 3
    int8 = _layout("int8")
    prints = {base.fingerprint(), int8.fingerprint(), _layout("bfloat16").fingerprint(),
              _layout(block_size=8).fingerprint(),
              # The numerics the stored dtype does not show (issue 42: identity).
              dataclasses.replace(int8, compute_dtype="bfloat16").fingerprint(),
              dataclasses.replace(base, kernels="linear=onednn").fingerprint()}  # fmt: skip
    assert len(prints) == 6
    assert base.fingerprint() == dataclasses.replace(base).fingerprint()


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_eight_bit_round_trip_is_close_and_scales_live_in_the_block(dtype: str) -> None:
    torch.manual_seed(0)
    layout = _layout(dtype)
    assert layout.quantized and layout.scale_bytes == LAYERS * 2 * KV_HEADS * 4
    cache = KvCache(layout, 4, CPU)
    k = torch.randn(BLOCK, KV_HEADS, HEAD_DIM)
    v = torch.randn(BLOCK, KV_HEADS, HEAD_DIM) * 5
    cache.write(2, k, v, cache.plan_write(_slots([1] * BLOCK, list(range(BLOCK)))))
    got_k, got_v = cache.layer(2).gather(torch.tensor([1]), torch.float32)
    tol = 0.01 if dtype == "int8" else 0.07  # of each head's largest magnitude
    for want, got in ((k, got_k[0]), (v, got_v[0])):
        err = (want - got).abs().amax(dim=(0, 2)) / want.abs().amax(dim=(0, 2))
        assert float(err.max()) < tol
    assert cache.scales is not None
    assert torch.allclose(
        cache.scales[1, 2, 1], v.abs().amax(dim=(0, 2)) / (127 if dtype == "int8" else 448)
    )
    copy = KvCache(layout, 4, CPU)
    copy.blocks[3] = cache.blocks[1]  # scales travel with the block's bytes
    again = copy.layer(2).gather(torch.tensor([3]), torch.float32)
    torch.testing.assert_close(again[1], got_v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_a_growing_scale_re_expresses_earlier_tokens(dtype: str) -> None:
    layout = _layout(dtype)
    cache = KvCache(layout, 2, CPU)
    small = torch.full((1, KV_HEADS, HEAD_DIM), 0.5)
    big = torch.full((1, KV_HEADS, HEAD_DIM), 8.0)
    cache.write(0, small, small, cache.plan_write(_slots([1], [0])))
    cache.write(0, big, big, cache.plan_write(_slots([1], [1])))  # a decode step later
    k, _ = cache.layer(0).gather(torch.tensor([1]), torch.float32)
    torch.testing.assert_close(k[0, 0], small[0], rtol=0.07, atol=0.0)
    torch.testing.assert_close(k[0, 1], big[0], rtol=0.01, atol=0.0)


def test_a_block_started_at_offset_zero_drops_its_previous_owners_scale() -> None:
    layout = _layout("int8")
    cache = KvCache(layout, 2, CPU)
    huge = torch.full((1, KV_HEADS, HEAD_DIM), 1000.0)
    cache.write(0, huge, huge, cache.plan_write(_slots([1], [0])))
    # The block is freed and handed to a new request, which starts it at offset 0.
    tiny = torch.full((1, KV_HEADS, HEAD_DIM), 0.01)
    cache.write(0, tiny, tiny, cache.plan_write(_slots([1], [0])))
    k, _ = cache.layer(0).gather(torch.tensor([1]), torch.float32)
    torch.testing.assert_close(k[0, 0], tiny[0], rtol=0.01, atol=0.0)
    assert int(k[0, 1:].count_nonzero()) == 0  # the previous owner's bytes are gone


def test_eight_bit_blocks_fit_about_two_and_four_times_more() -> None:
    smol = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    budget = 256 << 20
    counts = {d: blocks_for_budget(_layout(d, **smol), budget)
              for d in ("float32", "bfloat16", "int8", "float8_e4m3fn")}  # fmt: skip
    assert counts["int8"] == counts["float8_e4m3fn"]
    assert counts["int8"] >= 1.9 * counts["bfloat16"]
    assert counts["int8"] >= 3.5 * counts["float32"]


def test_bad_cache_dtype_and_flash_with_an_8bit_cache_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype is KvCacheDType.FP8_E4M3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype auto"):
        select_backend("flash", CPU, torch.bfloat16, quantized_kv=True)
    assert select_backend("auto", CPU, torch.bfloat16, quantized_kv=True).name == "torch"


def test_fp8_reads_bit_for_bit_through_bfloat16() -> None:
    """Every e4m3 value the cache stores (zero and the finite normals) comes back exact:
    times 2**-120 in bfloat16 (bits moved, no cast), as itself in float32."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    stored = want.isfinite() & ((want == 0) | (want.abs() >= 2.0**-6))
    assert int(stored.sum()) == 256 - 2 - 14  # NaNs and the 2 x 7 subnormals are not stored
    bits = codes.view(torch.int8)
    shifted, exponent = _as_dtype(bits, torch.float8_e4m3fn, torch.bfloat16)
    assert shifted.dtype == torch.bfloat16 and exponent == -120
    assert torch.equal(shifted.float()[stored] * 2.0**120, want[stored])
    exact, none = _as_dtype(bits, torch.float8_e4m3fn, torch.float32)
    assert none == 0 and torch.equal(exact[stored], want[stored])


def test_fp8_stores_tiny_values_as_zero_not_as_subnormals() -> None:
    cache = KvCache(_layout("float8_e4m3fn"), 2, CPU)
    x = torch.logspace(0, -8, KV_HEADS * HEAD_DIM).view(1, KV_HEADS, HEAD_DIM)
    cache.write(0, x, x, cache.plan_write(_slots([1], [0])))
    codes = cache.layer(0).k[1, 0].contiguous().view(torch.uint8)
    subnormal = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
    assert not bool(subnormal.any())
    assert int((codes & 0x7F).eq(0).sum()) > 0  # the tiniest did become zero


def test_a_partly_written_fp8_block_gets_headroom_and_filled_blocks_exact_scales() -> None:
    cache = KvCache(_layout("float8_e4m3fn"), 3, CPU)
    assert cache.scales is not None
    one = torch.ones(1, KV_HEADS, HEAD_DIM)
    cache.write(0, one, one, cache.plan_write(_slots([1], [0])))  # a decode's new block
    torch.testing.assert_close(cache.scales[1, 0], torch.full((2, KV_HEADS), 8.0 / 448))
    first = cache.layer(0).kv[1, :, 0].clone()
    # A later token a little larger fits the headroom: nothing is re-expressed.
    cache.write(0, one * 1.1, one * 1.1, cache.plan_write(_slots([1], [1])))
    torch.testing.assert_close(cache.scales[1, 0], torch.full((2, KV_HEADS), 8.0 / 448))
    assert torch.equal(cache.layer(0).kv[1, :, 0].view(torch.uint8), first.view(torch.uint8))
    full = torch.randn(BLOCK, KV_HEADS, HEAD_DIM)
    cache.write(0, full, full, cache.plan_write(_slots([2] * BLOCK, list(range(BLOCK)))))
    torch.testing.assert_close(cache.scales[2, 0, 0], full.abs().amax(dim=(0, 2)) / 448)


def test_an_int8_scale_grows_to_exactly_what_its_tokens_need() -> None:
    cache = KvCache(_layout("int8"), 2, CPU)
    assert cache.scales is not None
    one = torch.ones(1, KV_HEADS, HEAD_DIM)
    cache.write(0, one, one, cache.plan_write(_slots([1], [0])))
    torch.testing.assert_close(cache.scales[1, 0], torch.full((2, KV_HEADS), 1.0 / 127))
    cache.write(0, one * 1.1, one * 1.1, cache.plan_write(_slots([1], [1])))
    torch.testing.assert_close(cache.scales[1, 0], torch.full((2, KV_HEADS), 1.1 / 127))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("head_dim", [4, 12])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_rows_of_any_width_copy_exactly_from_misaligned_views(
    dtype: str, head_dim: int, compiled: bool
) -> None:
    """Writes and reads copy rows as the widest words that divide them (4- and 12-byte
    int8 rows: int32; the rest int64), from source views that start off any word."""
    torch.manual_seed(1)
    layout = _layout(dtype, head_dim=head_dim, num_kv_heads=1)
    cache = KvCache(layout, 3, CPU, compiled=compiled)
    # K and V as views one element into a wider tensor: their rows start off any word.
    qkv = torch.randn(2, 1 + 2 * head_dim, dtype=layout.torch_dtype if dtype != "int8" else None)
    k = qkv[:, 1 : 1 + head_dim].view(2, 1, head_dim)
    v = qkv[:, 1 + head_dim :].view(2, 1, head_dim)
    cache.write(1, k, v, cache.plan_write(_slots([2, 2], [1, 2])))
    got_k, got_v = cache.layer(1).gather(torch.tensor([2]), torch.float32)
    if dtype == "int8":  # quantized: within half a step of each head's scale
        for want, got in ((k, got_k), (v, got_v)):
            step = float(want.abs().max()) / 127
            assert torch.allclose(got[0, 1:3], want.float(), rtol=0, atol=step)
        return
    torch.testing.assert_close(got_k[0, 1:3], k.float(), rtol=0, atol=0)
    torch.testing.assert_close(got_v[0, 1:3], v.float(), rtol=0, atol=0)
    assert int(got_k[0, 0].count_nonzero()) == 0 and int(got_k[0, 3].count_nonzero()) == 0
