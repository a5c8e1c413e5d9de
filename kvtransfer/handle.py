"""Building and checking KvHandle messages.

A KvHandle crosses two hops (prefill -> gateway -> decode), so the importer re-checks
everything that must hold before it touches memory: protocol version, layout, block
count against token count, a checksum per block when it verifies them, that the lease has
not already run out, and that the request and the KV agree on the LoRA adapter
(`handle_adapter`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.adapter_ref import AdapterRef
from engine.errors import AdapterMismatchError
from engine.kv_layout import KvLayout
from kvtransfer.errors import InvalidHandleError, LayoutMismatchError, LeaseExpiredError
from pdserve.v1 import common_pb2

#: Version of the KvHandle/handshake protocol; peers refuse any other.
#: 2: ReadBlocks streams whole blocks of the block-major pool.
#: 3: handles carry the LoRA adapter's digest (a peer of 2 would take adapter KV for the
#:    base model's).
#: 4: handles carry a checksum per block (a peer of 3 sends none, so nothing it sent
#:    could be verified).
PROTOCOL_VERSION = 4


def validate_handle(
    handle: common_pb2.KvHandle,
    layout: KvLayout,
    prompt_token_ids: Sequence[int],
    backend: str,
    *,
    checksums: bool = True,
) -> None:
    """Raise InvalidHandleError (or a subclass) if the handle cannot serve this request;
    with `checksums`, it must carry one per block."""
    if handle.protocol_version != PROTOCOL_VERSION:
        raise InvalidHandleError(
            f"kv_handle.protocol_version: {handle.protocol_version} is not supported "
            f"(this worker speaks {PROTOCOL_VERSION})"
        )
    if handle.layout_fingerprint != layout.fingerprint():
        raise LayoutMismatchError(
            f"kv_handle.layout_fingerprint: the exporter's KV layout "
            f"{handle.layout_fingerprint!r} differs from this worker's "
            f"{layout.fingerprint()!r} ({layout.describe()})"
        )
    if handle.backend != backend:
        raise InvalidHandleError(
            f"kv_handle.backend: {handle.backend!r} but this worker imports with {backend!r}"
        )
    for name in ("engine_id", "incarnation", "transfer_address", "lease_id"):
        if not getattr(handle, name):
            raise InvalidHandleError(f"kv_handle.{name}: must not be empty")
    if handle.num_tokens != len(prompt_token_ids):
        raise InvalidHandleError(
            f"kv_handle.num_tokens: {handle.num_tokens} but the prompt has "
            f"{len(prompt_token_ids)} tokens"
        )
    expected_blocks = -(-handle.num_tokens // layout.block_size)
    if len(handle.block_ids) != expected_blocks:
        raise InvalidHandleError(
            f"kv_handle.block_ids: {len(handle.block_ids)} blocks for {handle.num_tokens} "
            f"tokens; expected {expected_blocks}"
        )
    if checksums and len(handle.block_checksums) != expected_blocks:
        why = " (the exporter runs with kv_checksum off)" if not handle.block_checksums else ""
        raise InvalidHandleError(
            f"kv_handle.block_checksums: {len(handle.block_checksums)} checksums for "
            f"{expected_blocks} blocks{why}; this worker verifies every block it imports"
        )
    if handle.lease_expiry_unix_ms and handle.lease_expiry_unix_ms < time.time() * 1000:
        raise LeaseExpiredError(f"kv_handle lease {handle.lease_id} has expired")


def handle_adapter(handle: common_pb2.KvHandle, adapter: str) -> AdapterRef | None:
    """The adapter to reserve with: named by the request, its digest the exporter's.
    A handle and a request that disagree on having an adapter at all are refused."""
    if bool(adapter) != bool(handle.adapter_digest):
        have = f"adapter {adapter!r}" if adapter else "the base model"
        sent = "KV of a LoRA adapter" if handle.adapter_digest else "base-model KV"
        raise AdapterMismatchError(
            f"model: the request runs {have} but the handle carries {sent}; prefill and "
            "decode must run the same adapter"
        )
    return AdapterRef(adapter, handle.adapter_digest) if adapter else None
