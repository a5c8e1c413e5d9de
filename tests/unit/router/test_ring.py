from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.ring import HashRing

N_KEYS = 2000


def test_walk_yields_every_member_once_clockwise_and_is_deterministic() -> None:
    ids = [f"w{i}" for i in range(10)]
    ring = HashRing(ids, virtual_nodes=64)
    same = HashRing(reversed(ids), virtual_nodes=64)
    for key in (0, 1, 2**63, 2**64 - 1, 12345678901234567):
        order = list(ring.walk(key))
        assert sorted(order) == sorted(ids)
        assert order == list(same.walk(key))
        assert ring.owner(key) == order[0]


def test_empty_ring_walks_nothing() -> None:
    ring = HashRing([])
    assert list(ring.walk(42)) == []
    assert ring.owner(42) is None


def test_load_is_spread_over_members() -> None:
    ring = HashRing([f"w{i}" for i in range(8)], virtual_nodes=64)
    rng = random.Random(0)
    owners = [ring.owner(rng.getrandbits(64)) for _ in range(8000)]
    shares = [owners.count(f"w{i}") / len(owners) for i in range(8)]
    assert max(shares) < 1.6 / 8 and min(shares) > 0.5 / 8


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 2**32 - 1), remove=st.booleans())
def test_one_membership_change_moves_about_one_nth_of_keys(n: int, seed: int, remove: bool) -> None:
    rng = random.Random(seed)
    ids = [f"w{seed}-{i}" for i in range(n)]
    keys = [rng.getrandbits(64) for _ in range(N_KEYS)]
    before = HashRing(ids)
    changed = ids[-1] if remove else f"new-{seed}"
    after = HashRing(ids[:-1]) if remove else HashRing([*ids, changed])
    moved = [k for k in keys if before.owner(k) != after.owner(k)]
    # Only keys leaving the removed worker, or landing on the added one, move ...
    assert all(changed in (before.owner(k), after.owner(k)) for k in moved)
    # ... and they are about 1/n of all keys.
    n_ref = max(len(before), len(after))
    assert len(moved) / N_KEYS <= 1.5 / n_ref + 0.02
