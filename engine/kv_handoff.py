"""The engine's KV hand-off: the interface KV transfer uses, and what it hands over.

The states themselves (HELD_FOR_EXPORT, WAITING_FOR_REMOTE_KV) and their transitions are
the scheduler's; `KvHandoff` (an engine's `handoff`) is the narrow interface over them
that kvtransfer's ports name (`kvtransfer/engine_port.py`). Prefill side: a request added
with `hold_kv=True` finishes with its blocks pinned (HELD_FOR_EXPORT) until
`release_held`; `held_kv` describes them without the step lock, and `release_held` never
waits (both run on a prefill worker's event loop). Decode side: `reserve_import` takes a
`RequestSpec` and reserves its blocks (WAITING_FOR_REMOTE_KV); they are filled from
outside, then `commit_import` makes the request join the batch as if it had prefilled
here, or `cancel_import` frees them; these three wait at most for the step in flight.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError, UnknownRequestError
from engine.finish_reason import FinishReason
from engine.intake import Intake
from engine.kv_cache import KvCache
from engine.kv_layout import KvLayout
from engine.request import Request
from engine.request_spec import RequestSpec
from engine.scheduler import Scheduler
from engine.step_gate import StepGate


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


@dataclass(frozen=True)
class HandoffParts:
    """What the hand-off works on: the pool's cache, the step gate, the scheduler (which
    owns the hand-off states), the index of held blocks, intake (which builds an import's
    request) and what to do when an import commits (`OutputStage.committed`)."""

    kv_cache: KvCache
    gate: StepGate
    scheduler: Scheduler
    held: HeldKvIndex
    intake: Intake
    committed: Callable[[Request], FinishReason | None]


class KvHandoff:
    """An engine's KV hand-off (kvtransfer's `ExportPort` and `ImportPort`)."""

    def __init__(self, parts: HandoffParts) -> None:
        self.parts = parts

    @property
    def layout(self) -> KvLayout:
        return self.parts.kv_cache.layout

    @property
    def kv_blocks(self) -> torch.Tensor:
        """The pool as [num_blocks, bytes_per_block] bytes: what KV transfer moves."""
        return self.parts.kv_cache.blocks

    # -- prefill side ------------------------------------------------------------------
    def held_kv(self, request_id: str) -> HeldKv:
        """The pinned blocks of a finished hold_kv request; UnknownRequestError if none.
        Never waits for a step."""
        return self.parts.held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """Unpin an exported request's blocks (full ones stay cached); False if not held.

        Never waits for a step: the blocks are freed now if none is running, else first
        thing in the next one.
        """
        if not self.parts.held.withdraw(request_id):
            return False
        self.parts.gate.run_or_defer(lambda: self._unpin(request_id))
        return True

    def _unpin(self, request_id: str) -> None:
        self.parts.scheduler.release_held(request_id)

    # -- decode side -------------------------------------------------------------------
    def reserve_import(
        self, spec: RequestSpec, first_token_id: int, fork_token_ids: Sequence[int] = ()
    ) -> ImportSlot:
        """Reserve blocks for `spec`'s prompt, whose KV comes from elsewhere (reusing
        cached prefix blocks); OutOfBlocksError if short, InvalidRequestError for a bad
        request, and the adapter errors of `LoraSet.acquire` (the spec's adapter digest is
        the exporter's, so KV computed with another copy of the adapter is refused).
        `first_token_id` is the exporter's first token; with n > 1, `fork_token_ids` are
        forks 1..n-1's, which the commit forks. A migrated stream's `resume_token_ids`
        replace `first_token_id` (the exporter's own draw, which an unseeded sample may
        not repeat), and the first step after the commit computes their KV after the
        imported prompt's."""
        with self.parts.intake.admit(spec) as req:
            _check_first_tokens(first_token_id, fork_token_ids, spec, self.parts.intake)
            if not spec.resume_token_ids:
                req.output_token_ids.append(first_token_id)
                if req.grammar is not None:  # the prefill worker sampled it under this grammar
                    req.grammar.advance([first_token_id])
            req.fork_token_ids = list(fork_token_ids)
            return self.parts.gate.between_steps(lambda: self._reserve(req))

    def _reserve(self, req: Request) -> ImportSlot:
        self.parts.intake.claim_id(req.request_id)
        cached = self.parts.scheduler.reserve_import(req)
        return ImportSlot(req.request_id, list(req.block_ids), cached)

    def commit_import(self, request_id: str) -> FinishReason | None:
        """The reserved blocks now hold the prompt's KV: queue the request to decode.

        Returns None when it was queued, else why it already ended, its blocks freed: the
        first token ended it (STOP for EOS or a stop, LENGTH for max_tokens or the context
        length), or it was aborted while its bytes landed (ABORT). UnknownRequestError if
        `request_id` is not importing.
        """
        return self.parts.gate.between_steps(lambda: self._commit(request_id))

    def _commit(self, request_id: str) -> FinishReason | None:
        req = self.parts.scheduler.commit_import(request_id)
        if req is None:
            return FinishReason.ABORT
        return self.parts.committed(req)

    def cancel_import(self, request_id: str) -> bool:
        """Free a reservation whose transfer failed or was cancelled; False if none."""
        scheduler = self.parts.scheduler
        return self.parts.gate.between_steps(lambda: scheduler.cancel_import(request_id))


def _check_first_tokens(
    first_token_id: int, fork_token_ids: Sequence[int], spec: RequestSpec, intake: Intake
) -> None:
    """The exporter's first tokens must be tokens, one per fork."""
    vocab = intake.limits.vocab_size
    if not 0 <= first_token_id < vocab:
        raise InvalidRequestError("first_token_id", f"must be in [0, {vocab})")
    n = spec.sampling.n
    if len(fork_token_ids) != n - 1:
        raise InvalidRequestError("fork_token_ids", f"must hold n - 1 = {n - 1} ids")
