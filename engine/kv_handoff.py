"""Engine methods that hand a request's KV blocks to another engine or take them in.

Prefill side: a request added with `hold_kv=True` finishes after its first token and its
blocks stay pinned (counted as held) until `release_held` — called when the decode side
has read them or the kvtransfer lease expired. Released full blocks stay in the prefix
cache. Decode side: `reserve_import` allocates the blocks a prompt needs, reusing any
leading blocks already in this engine's prefix cache (those need no transfer), and parks
the request as IMPORTING; after the bytes land, `commit_import` publishes the blocks to
the prefix cache and queues the request with its first token, so the next step decodes
token 2. `cancel_import` (or the engine's `abort`) frees a reservation. Every call takes
the engine lock, so none races a step.
"""

from __future__ import annotations

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
        self.held: dict[str, Request] = {}
        self.importing: dict[str, Request] = {}
        # Imports cancelled while their bytes may still be landing: the blocks are freed
        # when the importer commits or cancels, never under an in-flight transfer.
        self.cancelled: set[str] = set()

    def owns(self, request_id: str) -> bool:
        return request_id in self.held or request_id in self.importing

    def hold(self, req: Request) -> None:
        """Called by the engine when a hold_kv request finishes with its blocks pinned."""
        self.held[req.request_id] = req

    def held_kv(self, request_id: str) -> HeldKv:
        """The pinned blocks of a finished hold_kv request; UnknownRequestError if none."""
        with self._engine.lock:
            req = self.held.get(request_id)
            if req is None:
                raise UnknownRequestError(request_id)
            return HeldKv(
                request_id=request_id,
                block_ids=list(req.block_ids),
                num_tokens=req.num_computed_tokens,
                block_hashes=list(req.block_hashes),
                first_token_id=req.output_token_ids[0],
            )

    def release_held(self, request_id: str) -> bool:
        """Unpin an exported request's blocks (full ones stay cached); False if not held."""
        with self._engine.lock:
            req = self.held.pop(request_id, None)
            if req is None:
                return False
            self._engine.scheduler.release_blocks(req)
            return True

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
        with eng.lock:
            eng.claim_id(request_id)
            hits = self._cached_prefix(req)
            need = -(-req.num_prompt_tokens // eng.config.block_size) - len(hits)
            unpinned = sum(1 for b in hits if eng.pool.ref_count(b) == 0)
            if need > eng.pool.num_free - unpinned:
                raise OutOfBlocksError(f"import of {request_id} needs {need} KV blocks")
            eng.pool.touch(hits)
            req.block_ids = hits + eng.pool.allocate(need)
            req.num_cached_tokens = len(hits) * eng.config.block_size
            eng.scheduler.count_prefix(req)
            req.output_token_ids.append(first_token_id)
            req.status = RequestStatus.IMPORTING
            self.importing[request_id] = req
            return ImportSlot(request_id, list(req.block_ids), len(hits))

    def _cached_prefix(self, req: Request) -> list[int]:
        eng = self._engine
        eng.scheduler.extend_hashes(req, req.num_prompt_tokens)
        return eng.pool.longest_cached_prefix(req.block_hashes)

    def commit_import(self, request_id: str) -> bool:
        """The reserved blocks now hold the prompt's KV: queue the request to decode.

        Returns False when the first token already ended the request (EOS, a stop, or
        max_tokens 1): then nothing is queued and the blocks are freed.
        """
        eng = self._engine
        with eng.lock:
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
        with self._engine.lock:
            self.cancelled.discard(request_id)
            req = self.importing.pop(request_id, None)
            if req is None:
                return False
            self._engine.scheduler.release_blocks(req)
            return True

    def cancel_when_landed(self, request_id: str) -> bool:
        """Abort an import whose transfer may be in flight; False if not importing."""
        with self._engine.lock:
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
