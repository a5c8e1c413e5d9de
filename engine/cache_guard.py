"""The scheduler's side of cache fairness: which allocations a tenant's share limits, what
an admission must leave, and whose request gives way when a tenant runs short.

Where tenants share the pool (`BlockPool.num_tenants` > 1), a tenant with work in flight
must not take a lighter tenant's cached blocks (engine/cache_share.py): it waits for its
own. These allocations are guarded that way (`BlockPool.grow` with a `headroom`):
- An admission (a new or resumed request, an import's reservation) of a tenant with
  requests running, held for export or importing. It must also leave what the tenant's
  running requests still need to finish their prompts (at least a block each to grow
  into) and the rest of its own prompt past this chunk: admitting a prompt whose next
  chunk could only come from a lighter tenant would just move the eviction one step on.
- A prompt's next chunk while another request of its tenant runs: chunked prompts are
  how a flood grows, and left free they evicted the hot tenant's prefix (docs/history.md,
  "Cache fairness and the chunked flood"). Short only because of the guard, the chunk's
  request preempts its own tenant's (`gives_way`: the lowest class's newest, perhaps
  itself) instead of evicting a lighter tenant's blocks; the preempted request's full
  blocks stay cached, in its tenant's share, so its recompute is mostly a prefix hit.
  A decode's next block is not guarded: preempting a live stream (its ITL, its
  recompute) to spare a free cached block costs more than the block. Draft tokens'
  blocks are (`draft_room`): a bet never takes another tenant's cache.
Progress: a tenant's only running request grows into anyone's blocks, and a tenant with
nothing in flight is admitted into anyone's, so every tenant moves on. A pool short for
everyone preempts by class as before (the scheduler's `_victim`). With one tenant, nothing
here applies.

It reads the scheduler's queues (the same objects) and changes nothing; not thread-safe
(the step thread calls it).
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.block_pool import BlockPool
from engine.request import Request


class CacheGuard:
    """Guards one scheduler's allocations by tenant share (see the module doc)."""

    def __init__(
        self, pool: BlockPool, block_size: int, running: list[Request],
        held: Mapping[str, Request], importing: Mapping[str, Request],
    ) -> None:  # fmt: skip
        self.pool = pool
        self.block_size = block_size
        self._running = running
        self._holding = (held, importing)  # the hand-off states: they hold, never grow

    def admission_room(self, req: Request, num_tokens: int) -> int | None:
        """Blocks an admission of `req` covering `num_tokens` must leave free for its
        tenant; None when it is not guarded (one tenant, or nothing of its in flight)."""
        if self.pool.num_tenants < 2:
            return None
        mine = [r for r in self._running if _same_tenant(r, req)]
        holding = (r for states in self._holding for r in states.values())
        if not mine and not any(_same_tenant(r, req) for r in holding):
            return None
        room = max(0, self._blocks(req.num_tokens) - self._blocks(num_tokens))
        return room + sum(max(1, self._blocks(r.num_tokens) - len(r.block_ids)) for r in mine)

    def growth_room(self, req: Request) -> int | None:
        """0 when the growth of running `req` is guarded (a prompt chunk, while another
        request of its tenant runs), else None."""
        if self.pool.num_tenants < 2 or req.num_tokens - req.num_computed_tokens <= 1:
            return None
        others = any(r is not req and _same_tenant(r, req) for r in self._running)
        return 0 if others else None

    def draft_room(self) -> int | None:
        """0 (guarded) for draft tokens' blocks where tenants share the pool, else None."""
        return 0 if self.pool.num_tenants > 1 else None

    def gives_way(self, req: Request, num_tokens: int) -> list[int]:
        """Where in `running` the requests that may be preempted for `req`'s growth to
        `num_tokens` are: its own tenant's, when anyone's free blocks would do and only
        the guard stopped it; everyone's when the pool is short for all."""
        need = self._blocks(num_tokens) - len(req.block_ids)
        running = self._running
        if self.growth_room(req) is None or need > self.pool.num_free:
            return list(range(len(running)))
        return [i for i, r in enumerate(running) if _same_tenant(r, req)]

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _same_tenant(a: Request, b: Request) -> bool:
    return a.cache_owner.tenant == b.cache_owner.tenant
