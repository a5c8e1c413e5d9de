"""Engine methods that hand a request's KV blocks to another engine or take them in.

Prefill side: a request added with `hold_kv=True` finishes after its first token and its
blocks stay pinned (counted as held) until `release_held` — called when the decode side
has read them or the kvtransfer lease expired. Released full blocks stay in the prefix
cache. Decode side: `reserve_import` allocates the blocks a prompt needs, reusing any
leading blocks already in this engine's prefix cache (those need no transfer), and parks
the request as IMPORTING; after the bytes land, `commit_import` publishes the blocks to
the prefix cache and queues the request with its first token, so the next step decodes
token 2. `cancel_import` (or the engine's `abort`) frees a reservation.

Nothing here races a step, and nothing on the prefill side waits for one: a hold records
a snapshot of the pinned blocks (taken inside the step that finished the request), which
`held_kv` reads under its own small lock, and `release_held` unpins through the engine's
`run_or_defer`. A prefill worker calls both from its event loop, where waiting out a
multi-second chunk of someone else's long prompt would stall every other RPC. The
decode-side calls run off the event loop and go through `between_steps`, which waits at
most for the step in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError, OutOfBlocksError, UnknownRequestError
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine import LLMEngine


@dataclass(frozen=True)
class HeldKv:
    """Blocks pinned for export: `block_ids[i]` holds tokens [i*bs, (i+1)*bs)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    block_hashes: list[int]
    first_token_id: int


@dataclass(frozen=True)
class ImportSlot:
    """Where imported KV must be written: the blocks from `num_cached_blocks` on."""

    request_id: str
    block_ids: list[int]
    num_cached_blocks: int

    @property
    def blocks_to_fill(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks :]


class KvHandoff:
    """Held (exported) and importing requests of one engine; owned by `LLMEngine.handoff`."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.held: dict[str, Request] = {}  # pinned; changed only under the engine lock
        self.importing: dict[str, Request] = {}
        # What export reads without the engine lock: the snapshot of each held request not
        # yet released (a released one may stay in `held` until its unpin runs).
        self._exportable: dict[str, HeldKv] = {}
        self._exportable_lock = threading.Lock()
        # Imports cancelled while their bytes may still be landing: the blocks are freed
        # when the importer commits or cancels, never under an in-flight transfer.
        self.cancelled: set[str] = set()

    def owns(self, request_id: str) -> bool:
        return request_id in self.held or request_id in self.importing

    def hold(self, req: Request) -> None:
        """Called by the engine, inside the step, when a hold_kv request finishes pinned."""
        self.held[req.request_id] = req
        snapshot = HeldKv(
            request_id=req.request_id,
            block_ids=list(req.block_ids),
            num_tokens=req.num_computed_tokens,
            block_hashes=list(req.block_hashes),
            first_token_id=req.output_token_ids[0],
        )
        with self._exportable_lock:
            self._exportable[req.request_id] = snapshot

    def held_kv(self, request_id: str) -> HeldKv:
        """The pinned blocks of a finished hold_kv request; UnknownRequestError if none."""
        with self._exportable_lock:
            held = self._exportable.get(request_id)
        if held is None:
            raise UnknownRequestError(request_id)
        return held

    def release_held(self, request_id: str) -> bool:
        """Unpin an exported request's blocks (full ones stay cached); False if not held.

        Never waits for a step: the blocks are freed now if none is running, else first
        thing in the next one.
        """
        with self._exportable_lock:
            if self._exportable.pop(request_id, None) is None:
                return False
        self._engine.run_or_defer(lambda: self._unpin(request_id))
        return True

    def _unpin(self, request_id: str) -> None:
        req = self.held.pop(request_id, None)
        if req is not None:
            self._engine.scheduler.release_blocks(req)

    def reserve_import(
        self,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        sampling: SamplingParams,
        *,
        request_id: str,
        cache_salt: str = "",
    ) -> ImportSlot:
        """Allocate blocks for a prompt whose KV comes from elsewhere; OutOfBlocksError if short."""
        eng = self._engine
        eng.validate(prompt_token_ids, sampling)
        if not 0 <= first_token_id < eng.spec.vocab_size:
            raise InvalidRequestError("first_token_id", f"must be in [0, {eng.spec.vocab_size})")
        req = eng.new_request(request_id, prompt_token_ids, sampling, cache_salt, False)
        return eng.between_steps(lambda: self._reserve(req, first_token_id))

    def _reserve(self, req: Request, first_token_id: int) -> ImportSlot:
        eng = self._engine
        eng.claim_id(req.request_id)
        hits = self._cached_prefix(req)
        need = -(-req.num_prompt_tokens // eng.config.block_size) - len(hits)
        unpinned = sum(1 for b in hits if eng.pool.ref_count(b) == 0)
        if need > eng.pool.num_free - unpinned:
            raise OutOfBlocksError(f"import of {req.request_id} needs {need} KV blocks")
        eng.pool.touch(hits)
        req.block_ids = hits + eng.pool.allocate(need)
        req.num_cached_tokens = len(hits) * eng.config.block_size
        eng.scheduler.count_prefix(req)
        req.output_token_ids.append(first_token_id)
        req.status = RequestStatus.IMPORTING
        self.importing[req.request_id] = req
        return ImportSlot(req.request_id, list(req.block_ids), len(hits))

    def _cached_prefix(self, req: Request) -> list[int]:
        eng = self._engine
        eng.scheduler.extend_hashes(req, req.num_prompt_tokens)
        return eng.pool.longest_cached_prefix(req.block_hashes)

    def commit_import(self, request_id: str) -> bool:
        """The reserved blocks now hold the prompt's KV: queue the request to decode.

        Returns False when the first token already ended the request (EOS, a stop, or
        max_tokens 1): then nothing is queued and the blocks are freed.
        """
        return self._engine.between_steps(lambda: self._commit(request_id))

    def _commit(self, request_id: str) -> bool:
        eng = self._engine
        req = self.importing.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(request_id)
        if request_id in self.cancelled:
            self.cancelled.discard(request_id)
            eng.scheduler.release_blocks(req)
            return False
        req.num_computed_tokens = req.num_prompt_tokens
        eng.scheduler.publish_full_blocks(req)
        if eng.stop_checker.check(req) is not None:
            # The first token already ended it (EOS, max_tokens 1): nothing to decode.
            eng.scheduler.release_blocks(req)
            return False
        eng.requests[request_id] = req
        req.arrival_time = time.monotonic()  # decode's queue starts now, not at reserve
        eng.scheduler.add(req)
        return True

    def cancel_import(self, request_id: str) -> bool:
        """Free a reservation whose transfer failed or was cancelled; False if none."""
        return self._engine.between_steps(lambda: self._cancel(request_id))

    def _cancel(self, request_id: str) -> bool:
        self.cancelled.discard(request_id)
        req = self.importing.pop(request_id, None)
        if req is None:
            return False
        self._engine.scheduler.release_blocks(req)
        return True

    def cancel_when_landed(self, request_id: str) -> bool:
        """Abort an import whose transfer may be in flight; False if not importing."""
        return self._engine.between_steps(lambda: self._mark_cancelled(request_id))

    def _mark_cancelled(self, request_id: str) -> bool:
        if request_id not in self.importing:
            return False
        self.cancelled.add(request_id)
        return True

    def blocks(self) -> tuple[int, int]:
        """(held blocks, importing blocks)."""
        return (
            sum(len(r.block_ids) for r in self.held.values()),
            sum(len(r.block_ids) for r in self.importing.values()),
        )
