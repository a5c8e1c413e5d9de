"""The KV layout on the wire, and the check that two peers can exchange blocks."""

from __future__ import annotations

from engine.kv_layout import KvLayout
from kvtransfer.errors import LayoutMismatchError
from pdserve.v1 import common_pb2

_FIELDS = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
           "memory_kind")  # fmt: skip


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
    )


def check_layout(local: KvLayout, remote: common_pb2.KvLayout) -> None:
    """Raise LayoutMismatchError naming every field that differs."""
    if remote.fingerprint == local.fingerprint():
        return
    diffs = [
        f"{name}: local {getattr(local, name)!r} vs peer {getattr(remote, name)!r}"
        for name in _FIELDS
        if str(getattr(local, name)) != str(getattr(remote, name))
    ]
    detail = "; ".join(diffs) or "layout version differs"
    raise LayoutMismatchError(f"KV layouts are incompatible ({detail})")
