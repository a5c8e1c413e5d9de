"""The row kernel (`engine.row_attention`): a query row's bits depend on its own tokens
alone, however its sequence is cut into calls, whatever other rows and sequences share
the call, whichever thread takes it; its result is attention's (against float64);
tables outside the pool are refused."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.row_attention import RowAttention

HEADS, KV_HEADS, HD, BS = 6, 2, 32, 8
BLOCKS = 96


@pytest.fixture(scope="module")
def kv() -> torch.Tensor:
    """A float32 pool [blocks, 2 (K, V), block_size, kv_heads, head_dim] whose layer
    view is strided, as the engine's (two layers side by side; this is the second)."""
    torch.manual_seed(0)
    pool = torch.randn(BLOCKS, 2, 2, BS, KV_HEADS, HD)
    return pool[:, 1]


def _attend(
    attention: RowAttention,
    kv: torch.Tensor,
    q: torch.Tensor,
    seqs: list[tuple[list[int], int, int]],
) -> torch.Tensor:
    """`seqs`: (blocks, new rows, tokens seen by the last) per sequence; q holds the
    sequences' new rows in order."""
    width = max(len(b) for b, _, _ in seqs)
    tables = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in seqs], dtype=torch.int32)
    plan = attention.plan(kv, tables, [n for _, n, _ in seqs], [s for _, _, s in seqs])
    return attention.attend(q, kv, plan)


def _exact(kv: torch.Tensor, q: torch.Tensor, blocks: list[int], position: int) -> torch.Tensor:
    """Attention of one query at `position` over tokens 0..position, in float64."""
    k = kv[blocks, 0].reshape(-1, KV_HEADS, HD)[: position + 1].double()
    v = kv[blocks, 1].reshape(-1, KV_HEADS, HD)[: position + 1].double()
    group = HEADS // KV_HEADS
    out = torch.empty(HEADS, HD, dtype=torch.float64)
    for h in range(HEADS):
        scores = k[:, h // group] @ q[h].double() / HD**0.5
        out[h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 150), seed=st.integers(0, 2**31), data=st.data())
def test_a_row_has_the_same_bits_however_its_sequence_is_cut(
    kv: torch.Tensor, length: int, seed: int, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(BLOCKS, generator=gen)[: -(-length // BS)].tolist()
    q = torch.randn(length, HEADS, HD, generator=gen)
    attention = RowAttention(threads=2)
    whole = _attend(attention, kv, q, [(blocks, length, length)])
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(length - 1, 1)), max_size=6))))
    edges = [0, *(c for c in cuts if c < length), length]
    parts = [
        _attend(attention, kv, q[a:b], [(blocks, b - a, b)]) for a, b in itertools.pairwise(edges)
    ]
    assert torch.equal(torch.cat(parts), whole)  # chunked prefill, decode steps, any mix
    for position in {0, length // 2, length - 1}:
        exact = _exact(kv, q[position], blocks, position)
        assert (whole[position].double() - exact).abs().max() < 1e-5


def test_rows_keep_their_bits_beside_other_sequences_and_on_any_thread(kv: torch.Tensor) -> None:
    torch.manual_seed(1)
    a_blocks, b_blocks, c_blocks = list(range(0, 20)), list(range(20, 30)), list(range(30, 31))
    qa, qb, qc = torch.randn(40, HEADS, HD), torch.randn(3, HEADS, HD), torch.randn(1, HEADS, HD)
    one_thread = RowAttention(threads=1)
    alone = [
        _attend(one_thread, kv, qa, [(a_blocks, 40, 150)]),
        _attend(one_thread, kv, qb, [(b_blocks, 3, 77)]),
        _attend(one_thread, kv, qc, [(c_blocks, 1, 5)]),
    ]
    seqs = [(c_blocks, 1, 5), (a_blocks, 40, 150), (b_blocks, 3, 77)]
    for threads in (1, 2, 3):
        attention = RowAttention(threads)
        attention.SPLIT_WORK = 1  # split even this small step across every thread
        together = _attend(attention, kv, torch.cat([qc, qa, qb]), seqs)
        assert torch.equal(together, torch.cat([alone[2], alone[0], alone[1]]))


def test_a_rows_bits_do_not_depend_on_the_block_it_shares_loads_with(kv: torch.Tensor) -> None:
    torch.manual_seed(2)
    blocks, q = list(range(40, 60)), torch.randn(37, HEADS, HD)
    got = []
    for rows in (1, 3, 8, 37):
        attention = RowAttention()
        attention.BLOCK_ROWS = rows
        got.append(_attend(attention, kv, q, [(blocks, 37, 150)]))
    assert all(torch.equal(g, got[0]) for g in got[1:])


def test_chunks_go_in_blocks_and_blocks_to_threads_by_work() -> None:
    attention = RowAttention(threads=2)
    attention.SPLIT_WORK = 1
    blocks = attention._blocks([1, 20, 1], [300, 50, 9])
    assert blocks.tolist() == [
        [0, 1, 0, 300],  # a decode row alone
        [1, 8, 1, 31], [9, 8, 1, 39], [17, 4, 1, 47],  # a chunk of 20 rows at 30..49
        [21, 1, 2, 9],
    ]  # fmt: skip
    assert attention._ranges(blocks) == [(0, 2), (2, 5)]  # 576 tokens seen against 543
    assert RowAttention(threads=4)._ranges(blocks[:2]) == [(0, 2)]  # too little to split


def test_tables_outside_the_pool_are_refused(kv: torch.Tensor) -> None:
    attention = RowAttention()
    q = torch.randn(1, HEADS, HD)
    with pytest.raises(IndexError, match="outside the KV pool"):
        _attend(attention, kv, q, [([BLOCKS], 1, 3)])
    with pytest.raises(IndexError, match="outside the KV pool"):
        _attend(attention, kv, q, [([0], 1, BS + 1)])  # one block cannot hold 9 tokens
    empty = attention.plan(kv, torch.zeros(0, 1, dtype=torch.int32), [], [])
    assert attention.attend(torch.empty(0, HEADS, HD), kv, empty).shape == (0, HEADS, HD)
