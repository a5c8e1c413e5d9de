"""Intake: a `RequestSpec` becomes a `Request` the scheduler can take, and waits for a step.

Lifecycle of one spec: `admit(spec)` checks it against the engine's limits
(`check_request`), holds its LoRA adapter, compiles its grammar, seeds its generator and,
for a migrated stream, puts its tokens so far in place (`_resume`); inside that block the
caller claims the id (`claim_id`) and either queues the request here (`queue`: the next
step hands it to the scheduler) or gives it to the scheduler itself (an import's
reservation). If the block raises, the adapter is let go again; once the scheduler holds
the request, its retirement lets go (`LLMEngine._let_go`).

The queues (`queue`, `queue_abort`) only take a short lock of their own, so a caller
never waits behind a step; the stepping thread empties them with `take` first thing in
each step.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from engine.cache_share import CacheOwner
from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler
from engine.lora import LoraAdapter
from engine.lora_set import LoraSet
from engine.prefix_hash import hash_seed
from engine.priority import Priority
from engine.request import Request
from engine.request_check import RequestLimits, check_request
from engine.request_spec import RequestSpec
from engine.sampler import new_generator
from engine.stats import ClassCounts
from engine.step_meter import prefill_backlog


@dataclass(frozen=True)
class IntakeParts:
    """What intake reads: the limits a request must fit, the model's fingerprint (which
    seeds every prefix-cache key), its adapters, its grammar compiler (built on first use),
    and the scheduler's live requests (ids are unique among them)."""

    limits: RequestLimits
    fingerprint: str
    loras: LoraSet
    grammars: Callable[[], GrammarCompiler]
    live: Mapping[str, Request]


class Intake:
    def __init__(self, parts: IntakeParts) -> None:
        self.parts = parts
        self._lock = threading.Lock()  # guards only the queues: never held for a step
        self._adds: list[Request] = []
        self._aborts: list[str] = []

    @property
    def limits(self) -> RequestLimits:
        return self.parts.limits

    def hash_seed_for(self, cache_salt: str = "", lora: LoraAdapter | None = None) -> int:
        """The seed of a request's prefix-cache keys: model, tenant and adapter."""
        digest = "" if lora is None else lora.digest
        return hash_seed(self.parts.fingerprint, cache_salt, digest)

    @contextlib.contextmanager
    def admit(self, spec: RequestSpec, *, hold_kv: bool = False) -> Iterator[Request]:
        """The checked request for `spec`, its adapter held; if the block raises, the
        adapter is let go. Raises InvalidRequestError and the adapter errors of
        `LoraSet.acquire`."""
        check_request(spec, self.parts.limits)
        lora = None
        if spec.adapter is not None:
            lora = self.parts.loras.acquire(spec.adapter.name, spec.adapter.digest)
        try:
            yield self._build(spec, hold_kv, lora)
        except BaseException:
            if lora is not None:
                self.parts.loras.release(lora)
            raise

    def _build(self, spec: RequestSpec, hold_kv: bool, lora: LoraAdapter | None) -> Request:
        sampling = spec.sampling
        guided = sampling.guided
        req = Request(
            request_id=spec.request_id or uuid.uuid4().hex,
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling=sampling,
            hash_seed=self.hash_seed_for(spec.cache_salt, lora),
            cache_owner=CacheOwner(spec.cache_salt, spec.cache_weight),
            lora=lora,
            hold_kv=hold_kv,
            priority=Priority(spec.priority),
            deadline=spec.deadline,
            generator=None if sampling.greedy else new_generator(sampling.seed),
            grammar=None if guided is None else self.parts.grammars().matcher(guided),
        )
        if spec.resume_token_ids:
            _resume(req, spec.resume_token_ids)
        return req

    def claim_id(self, request_id: str) -> None:
        """Refuse an id that a live request already has (queued or in any state)."""
        with self._lock:
            queued = any(r.request_id == request_id for r in self._adds)
        if queued or request_id in self.parts.live:
            raise InvalidRequestError(
                "request_id", "must be unique among live requests", request_id
            )

    # -- the queues between callers and the stepping thread ---------------------------
    def queue(self, req: Request) -> None:
        with self._lock:
            self._adds.append(req)

    def queue_abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def take(self) -> tuple[list[Request], list[str]]:
        """Everything queued since the last call: (requests to add, ids to abort)."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        return adds, aborts

    def pending(self) -> bool:
        with self._lock:
            return bool(self._adds or self._aborts)

    def arriving(self) -> ClassCounts:
        """The prompt tokens of requests queued but not yet scheduled, by class."""
        with self._lock:
            return prefill_backlog(self._adds)


def _resume(req: Request, output: Sequence[int]) -> None:
    """Make `req` continue after `output`: it is queued as a preempted request is, with
    its output so far, so its first step computes the KV of prompt + output and samples
    the next token. Penalties, min_tokens, stop checks and max_tokens count that output,
    the grammar is advanced through it, and a seeded request's next draw is keyed on its
    position (`Request.draw_generator`): greedy and seeded streams go on exactly as one
    engine would have run them. (`check_request` has checked `output`.)"""
    req.output_token_ids = list(output)
    if req.grammar is not None:
        req.grammar.advance(output)
