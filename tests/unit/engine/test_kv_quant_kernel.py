"""The compiled 8-bit KV write (numba) against the torch write it replaces on CPU.

Both write into a `KvCache` on the same small synthetic layout, so the comparison is of
whole pools, byte for byte: data, scales, re-expressed tokens and zeroed fresh blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv_cache import _FP8_FLUSH, KvCache, _as_dtype
from engine.kv_layout import KvLayout
from engine.kv_quant_kernel import FP8, INT8, decode_table, encode_into

CPU = torch.device("cpu")
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 4
EIGHT_BIT = ["int8", "float8_e4m3fn"]


def _layout(dtype: str) -> KvLayout:
    return KvLayout(model_fingerprint="m", dtype=dtype, block_size=BLOCK, num_layers=LAYERS,
                    num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, memory_kind="cpu")  # fmt: skip


def _kv(gen: torch.Generator, tokens: int) -> torch.Tensor:
    """K and V for `tokens` tokens: mostly small, some heads with outliers up to 40x, so
    scales grow inside partly written blocks; bfloat16, as the engine computes them."""
    x = torch.randn(2, tokens, KV_HEADS, HEAD_DIM, generator=gen)
    spikes = torch.rand(2, tokens, KV_HEADS, 1, generator=gen) < 0.3
    grow = torch.rand(2, tokens, KV_HEADS, 1, generator=gen) * 40
    return torch.where(spikes, x * grow, x).bfloat16()


def _steps() -> list[list[tuple[int, int]]]:
    """(block, offset) of each token, step by step: two prefills that share no block,
    one of them ending mid-block, then decode steps that fill and start blocks, and a
    block reused from offset 0 by a new owner."""
    prefill = [(1, o) for o in range(BLOCK)] + [(2, 0), (2, 1)] + [(5, 0), (5, 1), (5, 2)]
    steps = [prefill]
    for o in range(2, BLOCK):  # sequence A fills block 2, B fills block 5
        steps.append([(2, o), (5, min(o + 1, BLOCK - 1))])
    steps.append([(3, 0), (6, 0)])  # both start fresh blocks
    steps.append([(3, 1), (1, 0)])  # block 1, freed and handed on, restarts at offset 0
    steps.append([(3, 2), (3, 3), (1, 1)])  # a verify step: two tokens in block 3
    return steps


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_the_compiled_write_is_the_torch_write_byte_for_byte(dtype: str) -> None:
    gen = torch.Generator().manual_seed(7)
    compiled, reference = (KvCache(_layout(dtype), 8, CPU, compiled=c) for c in (True, False))
    assert compiled._writer is not None and reference._writer is None
    for step in _steps():
        slots = torch.tensor([b * BLOCK + o for b, o in step])
        plans = compiled.plan_write(slots), reference.plan_write(slots)
        for layer in range(LAYERS):
            k, v = _kv(gen, len(step))
            compiled.write(layer, k, v, plans[0])
            reference.write(layer, k, v, plans[1])
        assert torch.equal(compiled.blocks, reference.blocks), step
    assert compiled.scales is not None and bool((compiled.scales > 0).any())


def _encoded(values: torch.Tensor, kind: int) -> torch.Tensor:
    out = np.zeros(len(values), dtype=np.int8)
    flush_bits = int(np.array([_FP8_FLUSH], dtype=np.float32).view(np.int32)[0])
    encode_into(out, 0, values.float().numpy(), kind, flush_bits)
    return torch.from_numpy(out)


def test_fp8_encoding_matches_torch_rounding_saturation_and_flush() -> None:
    gen = torch.Generator().manual_seed(3)
    # Every code e4m3 has, the midpoints between them (ties), a log-uniform spread and
    # the edges: the flush, the smallest normal, saturation; both signs.
    grid = torch.arange(0, 127, dtype=torch.int16).to(torch.int8).view(torch.float8_e4m3fn)
    grid = grid.float()
    mids = (grid[1:] + grid[:-1]) / 2
    spread = torch.exp(torch.empty(4000).uniform_(-12, 7, generator=gen))
    edges = torch.tensor([_FP8_FLUSH, _FP8_FLUSH * 1.0001, 2.0**-6, 447.9, 448, 460, 1e6, 0])
    values = torch.cat((grid, mids, spread, edges)).float()
    values = torch.cat((values, -values))
    want = torch.nn.functional.hardshrink(values.clamp(-448, 448), _FP8_FLUSH)
    want_bits = want.to(torch.float8_e4m3fn).view(torch.int8)
    got = _encoded(values, FP8)
    assert torch.equal(got, want_bits)


def test_int8_encoding_rounds_half_to_even_and_clamps() -> None:
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.4, -127.6, 300.0, 0.49])
    assert _encoded(values, INT8).tolist() == [0, 2, 2, 0, -2, 126, 127, -127, 127, 0]


def test_the_decode_table_reads_every_byte_as_the_cache_does() -> None:
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    unsigned = codes.view(torch.uint8).long()
    assert torch.equal(torch.from_numpy(decode_table(INT8))[unsigned], codes.float())
    fp8 = torch.from_numpy(decode_table(FP8))[unsigned]
    read, exponent = _as_dtype(codes, torch.float8_e4m3fn, torch.float32)
    assert exponent == 0 and torch.equal(fp8, read)  # NaN codes included (+-480)


def _random_steps(gen: torch.Generator, num_blocks: int) -> list[list[tuple[int, int]]]:
    """Steps of a small simulated engine: sequences arrive with prompts of 1-11 tokens,
    prefill in chunks of up to 5, decode a token a step (sometimes 2, a verify step),
    and free their blocks when done, which later sequences reuse from offset 0."""
    free, live, steps = list(range(1, num_blocks)), [], []
    for _ in range(40):
        if len(live) < 3 and int(torch.randint(0, 2, (1,), generator=gen)):
            prompt = int(torch.randint(1, 12, (1,), generator=gen))
            live.append({"blocks": [], "len": 0, "todo": prompt, "decode": 6})
        step: list[tuple[int, int]] = []
        for seq in live:
            n = (
                min(seq["todo"], 5)
                if seq["todo"]
                else int(torch.randint(1, 3, (1,), generator=gen))
            )
            for _ in range(n):
                if seq["len"] % BLOCK == 0:
                    seq["blocks"].append(free.pop(0))
                step.append((seq["blocks"][-1], seq["len"] % BLOCK))
                seq["len"] += 1
            if seq["todo"]:
                seq["todo"] -= n
            else:
                seq["decode"] -= 1
        for seq in [s for s in live if not s["todo"] and s["decode"] <= 0]:
            free.extend(seq["blocks"])
            live.remove(seq)
        if step:
            steps.append(step)
    return steps


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_random_engine_steps_write_the_same_pool_both_ways(dtype: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pools = [KvCache(_layout(dtype), 24, CPU, compiled=c) for c in (True, False)]
    for step in _random_steps(gen, 24):
        slots = torch.tensor([b * BLOCK + o for b, o in step])
        plans = [pool.plan_write(slots) for pool in pools]
        for layer in range(LAYERS):
            k, v = _kv(gen, len(step))
            for pool, plan in zip(pools, plans, strict=True):
                pool.write(layer, k, v, plan)
        assert torch.equal(pools[0].blocks, pools[1].blocks), step


@pytest.mark.parametrize("block", [-1, 8])
def test_a_slot_outside_the_pool_is_refused_before_the_compiled_write(block: int) -> None:
    cache = KvCache(_layout("int8"), 8, CPU)
    before = cache.blocks.clone()
    with pytest.raises(IndexError, match="outside the pool of 8"):
        cache.plan_write(torch.tensor([3 * BLOCK + 1, block * BLOCK + 2]))
    assert torch.equal(cache.blocks, before)


def test_the_torch_write_serves_when_the_kernel_cannot_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: object) -> None:
        raise RuntimeError("no cache directory")

    monkeypatch.setattr("engine.kv_quant_kernel.QuantWriter.__post_init__", broken)
    cache = KvCache(_layout("int8"), 4, CPU)
    assert cache._writer is None
    k = torch.ones(1, KV_HEADS, HEAD_DIM)
    cache.write(0, k, k, cache.plan_write(torch.tensor([2 * BLOCK])))
    got, _ = cache.layer(0).gather(torch.tensor([2]), torch.float32)
    torch.testing.assert_close(got[0, 0], k[0])
