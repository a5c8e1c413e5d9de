"""LeaseTable: every lease ends exactly once, by release, request cancel, expiry or close."""

from __future__ import annotations

import pytest

from engine.kv_layout import KvLayout, kernel_family
from kvtransfer.errors import LayoutMismatchError
from kvtransfer.layout import check_layout, layout_to_proto
from kvtransfer.leases import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(ttl: float = 5.0) -> tuple[LeaseTable, list[str], Clock]:
    released: list[str] = []
    clock = Clock()
    return LeaseTable(ttl, released.append, clock=clock), released, clock


def test_release_ends_a_lease_once() -> None:
    table, released, _ = _table()
    lease = table.grant("r1", [1, 2, 3])
    assert table.get(lease.lease_id) == lease
    assert table.stats().pinned_blocks == 3
    assert table.release(lease.lease_id)
    assert not table.release(lease.lease_id)
    assert released == ["r1"]
    s = table.stats()
    assert (s.active, s.pinned_blocks, s.released, s.expired) == (0, 0, 1, 0)


def test_expiry_unpins_and_is_counted() -> None:
    table, released, clock = _table(ttl=5.0)
    a = table.grant("a", [1])
    clock.now += 3
    b = table.grant("b", [2])
    clock.now += 2.5
    assert table.get(a.lease_id) is None
    assert table.expire_due() == 1
    assert released == ["a"]
    assert table.get(b.lease_id) == b
    assert not table.release(a.lease_id)
    clock.now += 10
    assert table.expire_due() == 1
    assert table.stats().expired == 2 and table.stats().active == 0


def test_release_request_and_release_all() -> None:
    table, released, _ = _table()
    table.grant("a", [1])
    table.grant("b", [2])
    table.grant("c", [3])
    assert table.release_request("b")
    assert not table.release_request("b")
    assert table.release_all() == 2
    assert sorted(released) == ["a", "b", "c"]
    assert table.stats().active == 0


def _layout(**overrides: object) -> KvLayout:
    fields: dict[str, object] = {
        "model_fingerprint": "m",
        "dtype": "float32",
        "block_size": 16,
        "num_layers": 30,
        "num_kv_heads": 3,
        "head_dim": 64,
        "memory_kind": "cpu",
    }
    fields.update(overrides)
    return KvLayout(**fields)  # type: ignore[arg-type]


def test_layout_check_names_every_difference() -> None:
    local = _layout()
    check_layout(local, layout_to_proto(_layout()))
    with pytest.raises(LayoutMismatchError) as info:
        check_layout(local, layout_to_proto(_layout(block_size=32, dtype="bfloat16")))
    assert "block_size" in str(info.value) and "dtype" in str(info.value)
    assert info.value.code.name == "INVALID_ARGUMENT"
    # An 8-bit cache and an unquantized one never exchange blocks.
    with pytest.raises(LayoutMismatchError, match="dtype: local 'float32' vs peer 'int8'"):
        check_layout(local, layout_to_proto(_layout(dtype="int8")))
    # The same 8-bit cache computed in another dtype, or by other kernels: refused,
    # each side's value named.
    int8 = _layout(dtype="int8", compute_dtype="bfloat16")
    with pytest.raises(
        LayoutMismatchError, match="compute_dtype: local 'bfloat16' vs peer 'float32'"
    ):
        check_layout(int8, layout_to_proto(_layout(dtype="int8", compute_dtype="float32")))
    fused, torch_only = kernel_family("onednn", 4, "torch"), kernel_family("onednn", 0, "torch")
    with pytest.raises(LayoutMismatchError, match=r"kernels: importer .*fused<=4.* vs exporter"):
        check_layout(_layout(kernels=fused), layout_to_proto(_layout(kernels=torch_only)),
                     "importer", "exporter")  # fmt: skip
    # A peer of another pool layout version (same fields, other fingerprint) is refused.
    old = layout_to_proto(_layout())
    old.fingerprint = "0123456789abcdef"
    with pytest.raises(LayoutMismatchError, match="layout version differs"):
        check_layout(local, old)
