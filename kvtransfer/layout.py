"""The KV layout on the wire, and the check that two peers can exchange blocks.

A mismatch is refused naming each side's value of every field that differs (the
compute dtype and kernels too: `engine.kv_layout` says why they are part of it), so an
operator sees "compute_dtype: exporter 'bfloat16' vs importer 'float32'", not two
hashes.
"""

from __future__ import annotations

from engine.kv_layout import KvLayout
from kvtransfer.errors import LayoutMismatchError
from pdserve.v1 import common_pb2

_FIELDS = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
           "memory_kind", "compute_dtype", "kernels")  # fmt: skip


def layout_to_proto(layout: KvLayout) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        memory_kind=layout.memory_kind,
        fingerprint=layout.fingerprint(),
        compute_dtype=layout.compute_dtype,
        kernels=layout.kernels,
    )


def layout_differences(
    local: KvLayout, remote: common_pb2.KvLayout, here: str = "local", there: str = "peer"
) -> str:
    """Every field in which `remote` differs from `local`, both sides named; "" if the
    fingerprints match."""
    if remote.fingerprint == local.fingerprint():
        return ""
    diffs = [
        f"{name}: {here} {getattr(local, name)!r} vs {there} {getattr(remote, name)!r}"
        for name in _FIELDS
        if str(getattr(local, name)) != str(getattr(remote, name))
    ]
    return "; ".join(diffs) or "layout version differs"


def check_layout(
    local: KvLayout, remote: common_pb2.KvLayout, here: str = "local", there: str = "peer"
) -> None:
    """Raise LayoutMismatchError naming every field that differs."""
    detail = layout_differences(local, remote, here, there)
    if detail:
        raise LayoutMismatchError(f"KV layouts are incompatible ({detail})")
