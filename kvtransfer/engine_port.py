"""What KV transfer needs from an engine: the blocks it may read or fill, and their states.

kvtransfer depends on these Protocols, never on the engine: an engine's hand-off
(`LLMEngine.handoff`, an `engine.kv_handoff.KvHandoff`) satisfies both, and so does a bare
pool in the transfer benchmark. Lifecycle, prefill side: the engine pins a finished
request's blocks (HELD_FOR_EXPORT); the exporter reads `held_kv`, leases the blocks, lets
a peer read them from `kv_blocks`, and calls `release_held` exactly once when the lease
ends. Decode side: the importer calls `reserve_import`, fills the slot's
`blocks_to_fill` in `kv_blocks`, then calls exactly one of `commit_import` or
`cancel_import`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.finish_reason import FinishReason
from engine.kv_handoff import HeldKv, ImportSlot
from engine.kv_layout import KvLayout
from engine.request_spec import RequestSpec


class HeldKvSource(Protocol):
    """Who pins exported blocks: an engine, or a bare pool in a benchmark."""

    def held_kv(self, request_id: str) -> HeldKv:
        """The pinned blocks of a held request; UnknownRequestError if none. Must not
        wait for an engine step (the exporter calls it from an event loop)."""
        ...

    def release_held(self, request_id: str) -> bool:
        """Unpin the request's blocks; False if not held. Must not wait for a step."""
        ...


class ExportPort(HeldKvSource, Protocol):
    """A prefill engine as the exporter sees it: its pinned blocks and its pool."""

    @property
    def layout(self) -> KvLayout: ...

    @property
    def kv_blocks(self) -> torch.Tensor:
        """The pool as [num_blocks, bytes_per_block] bytes (block-major: one block's KV
        of every layer, with its scales, is one row) that peers read held blocks from."""
        ...


class ImportPort(Protocol):
    """A decode engine as the importer sees it: reservations and the pool it fills.

    The three calls may wait for the step in flight; call them off an event loop.
    """

    @property
    def layout(self) -> KvLayout: ...

    @property
    def kv_blocks(self) -> torch.Tensor: ...

    def reserve_import(
        self, spec: RequestSpec, first_token_id: int, fork_token_ids: Sequence[int] = ()
    ) -> ImportSlot:
        """Reserve blocks for `spec`'s prompt, whose first token the exporter sampled
        (forks 1..n-1 start from `fork_token_ids` at the commit; a migrated stream goes
        on after `spec.resume_token_ids`); the spec's adapter digest must be the
        exporter's. Raises OutOfBlocksError when short (taking nothing),
        InvalidRequestError for a request the engine refuses and the adapter errors of
        `LLMEngine.add_request`."""
        ...

    def commit_import(self, request_id: str) -> FinishReason | None:
        """The slot's blocks hold the prompt's KV: queue the request (None), or say why it
        already ended (its blocks then freed)."""
        ...

    def cancel_import(self, request_id: str) -> bool:
        """Free the reservation; no transfer may still be writing into it."""
        ...
