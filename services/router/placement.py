"""Placement: the interface the gateway calls to pick workers, and a static version.

The gateway depends only on `Placement`. `StaticPlacement` serves a fixed list of
workers round-robin (what `pdserve up` uses until the Redis router is configured); the
Redis-backed router implements the same interface with bounded-load consistent hashing
on the prompt's prefix. `route` may be called again with `exclude` naming workers that
failed the request; `route_decode` places only the decode side again, for a request whose
prefill is done but whose decode worker refused it (full, or unreachable), leasing load on
the new decode worker only; `release` gives back whatever load the decision took. `release`
starts its work when it is called, not when it is first awaited: the gateway calls it
from cleanup code that can be cancelled at any await, and a release that only began on
its first step could be cancelled before it began.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine.adapter_ref import AdapterRef
from services.common.detached import done
from services.common.status import NoWorkerError as NoWorkerError  # raised by route


@dataclass(frozen=True)
class WorkerRef:
    worker_id: str
    address: str
    role: str


@dataclass(frozen=True)
class RouteDecision:
    """`prefill` is None when the pool is mixed: `decode` then runs the whole request.

    The load leases the decision holds are kept per side, so that a decode re-route can
    give back the decode worker's alone (`decode_load`) and keep the rest (`prefill_load`).
    """

    prefill: WorkerRef | None
    decode: WorkerRef
    prefill_lease_ids: tuple[str, ...] = ()
    decode_lease_ids: tuple[str, ...] = ()
    # Prompt tokens the router's model of the decode worker's prefix cache says it holds
    # (a lower bound: the model knows the first `prefix_blocks` blocks only); 0 unknown.
    decode_cached_tokens: int = 0

    @property
    def load_lease_ids(self) -> tuple[str, ...]:
        """Every load lease the decision holds (what `Placement.release` gives back)."""
        return self.prefill_lease_ids + self.decode_lease_ids

    def prefill_load(self) -> RouteDecision:
        """The same placement, holding only the prefill worker's load lease."""
        return replace(self, decode_lease_ids=())

    def decode_load(self) -> RouteDecision:
        """The same placement, holding only the decode worker's load lease."""
        return replace(self, prefill_lease_ids=())

    def on_prefill_worker(self) -> RouteDecision:
        """The prefill worker alone, running the request whole (elastic roles): its load
        lease is now the decision's decode lease, and the decode worker is out."""
        assert self.prefill is not None
        return RouteDecision(None, self.prefill, decode_lease_ids=self.prefill_lease_ids)

    def without_prefill(self) -> RouteDecision:
        """The decode worker alone, prefilling the request itself (no prefill hop)."""
        return replace(self, prefill=None, prefill_lease_ids=())


@dataclass(frozen=True)
class RouteQuery:
    """What placement needs to know of one request: its id, prompt and tenant (which key
    its prefix), its LoRA adapter (None: the base model), the workers it must not go to,
    and, when only its decode side is placed again, the worker already holding its KV."""

    request_id: str
    prompt_token_ids: Sequence[int]
    tenant: str
    exclude: Sequence[str] = ()
    adapter: AdapterRef | None = None
    prefill: WorkerRef | None = None

    def excluding(self, exclude: Sequence[str]) -> RouteQuery:
        return replace(self, exclude=tuple(exclude))


def _ref(entry: str, role: str) -> WorkerRef:
    worker_id, _, address = entry.rpartition("=")
    return WorkerRef(worker_id or address, address, role)


class Placement(Protocol):
    async def route(self, query: RouteQuery) -> RouteDecision:
        """Place a request (of LoRA `query.adapter`, None: the base model), excluding the
        ids in `query.exclude`, and lease load on its workers. Raises NoWorkerError."""
        ...

    async def route_decode(self, query: RouteQuery) -> RouteDecision:
        """Place the decode (or mixed) pool alone, excluding the ids in `query.exclude`,
        and lease load there only; the decision names `query.prefill`, the worker that
        already holds the request's KV. Raises NoWorkerError."""
        ...

    def release(self, decision: RouteDecision) -> Awaitable[None]:
        """Start giving back the decision's load; await the result to wait for it."""
        ...

    def report_down(self, worker_id: str) -> Awaitable[None]:
        """A call to the worker failed UNAVAILABLE: keep placements off it for a while
        (on every router sharing the registry). Starts at call time, as `release`."""
        ...

    def workers(self) -> list[WorkerRef]: ...


class StaticPlacement:
    """Round-robin over fixed prefill and decode lists (or one mixed list)."""

    def __init__(self, prefill: Sequence[WorkerRef], decode: Sequence[WorkerRef]) -> None:
        if not decode:
            raise ValueError("at least one decode (or mixed) worker is needed")
        self._prefill = list(prefill)
        self._decode = list(decode)
        self._lock = threading.Lock()
        self._next_p = itertools.count()
        self._next_d = itertools.count()

    @classmethod
    def from_addresses(cls, prefill: Sequence[str], decode: Sequence[str]) -> StaticPlacement:
        """Entries are `host:port` or `worker_id=host:port`."""
        role = "decode" if prefill else "mixed"
        return cls([_ref(a, "prefill") for a in prefill], [_ref(a, role) for a in decode])

    def workers(self) -> list[WorkerRef]:
        return self._prefill + self._decode

    async def route(self, query: RouteQuery) -> RouteDecision:
        exclude = query.exclude
        prefill = self._pick(self._prefill, self._next_p, exclude) if self._prefill else None
        if self._prefill and prefill is None:
            raise NoWorkerError("no prefill worker left to try")
        return RouteDecision(prefill, self._pick_decode(exclude))

    async def route_decode(self, query: RouteQuery) -> RouteDecision:
        return RouteDecision(query.prefill, self._pick_decode(query.exclude))

    def _pick_decode(self, exclude: Sequence[str]) -> WorkerRef:
        decode = self._pick(self._decode, self._next_d, exclude)
        if decode is None:
            raise NoWorkerError("no decode worker left to try")
        return decode

    def release(self, decision: RouteDecision) -> Awaitable[None]:
        return done()

    def report_down(self, worker_id: str) -> Awaitable[None]:
        return done()  # a fixed list: the failed call's own retry excludes the worker

    def _pick(
        self, pool: list[WorkerRef], counter: itertools.count[int], exclude: Sequence[str]
    ) -> WorkerRef | None:
        with self._lock:
            start = next(counter)
        for i in range(len(pool)):
            ref = pool[(start + i) % len(pool)]
            if ref.worker_id not in exclude:
                return ref
        return None
