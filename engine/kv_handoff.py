"""What the engine hands to KV transfer: descriptions of held and reserved blocks.

The states themselves (HELD_FOR_EXPORT, WAITING_FOR_REMOTE_KV) and their transitions are
the scheduler's; the engine's hand-off methods (`LLMEngine.held_kv`, `release_held`,
`reserve_import`, `commit_import`, `cancel_import`) are the narrow interface over them.

Lifecycle of a `HeldKv`: the step that finishes a hold_kv request publishes its snapshot
in the engine's `HeldKvIndex`; an exporter reads it with `get` from any thread, without
the engine lock (a prefill worker exports from its event loop, where waiting out a
multi-second chunk of someone else's prompt would stall every other RPC); `withdraw`
(on release or abort) removes it exactly once, before the blocks are unpinned, so no
snapshot ever names blocks that may have been handed out again.

An `ImportSlot` is returned by a reservation: the blocks a transfer must fill.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.errors import UnknownRequestError
from engine.request import Request


@dataclass(frozen=True)
class HeldKv:
    """Blocks pinned for export: `block_ids[i]` holds tokens [i*bs, (i+1)*bs)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    block_hashes: list[int]
    first_token_id: int
    fork_token_ids: list[int] = field(default_factory=list)  # n > 1: forks 1..n-1's
    adapter_digest: str = ""  # the LoRA adapter the KV was computed with ("": none)

    @classmethod
    def of(cls, req: Request) -> HeldKv:
        return cls(
            request_id=req.request_id,
            block_ids=list(req.block_ids),
            num_tokens=req.num_computed_tokens,
            block_hashes=list(req.block_hashes),
            first_token_id=req.output_token_ids[0],
            fork_token_ids=list(req.fork_token_ids),
            adapter_digest="" if req.lora is None else req.lora.digest,
        )


@dataclass(frozen=True)
class ImportSlot:
    """Where imported KV must be written: the blocks from `num_cached_blocks` on."""

    request_id: str
    block_ids: list[int]
    num_cached_blocks: int

    @property
    def blocks_to_fill(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks :]


class HeldKvIndex:
    """Snapshots of the held requests not yet released; thread-safe, never waits on a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, HeldKv] = {}

    def publish(self, held: HeldKv) -> None:
        with self._lock:
            self._held[held.request_id] = held

    def get(self, request_id: str) -> HeldKv:
        """The snapshot; UnknownRequestError if the request is not held (or released)."""
        with self._lock:
            held = self._held.get(request_id)
        if held is None:
            raise UnknownRequestError(request_id)
        return held

    def withdraw(self, request_id: str) -> bool:
        """Remove the snapshot; True only for the first caller."""
        with self._lock:
            return self._held.pop(request_id, None) is not None
