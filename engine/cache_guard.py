"""The scheduler's side of cache fairness: which allocations a tenant's share limits, what
an admission must leave, and whose request gives way when a tenant runs short.

Where tenants share the pool (`BlockPool.num_tenants` > 1), a tenant with work in flight
must not take a lighter tenant's cached blocks (engine/cache_share.py): it waits for its
own. These allocations are guarded that way (`BlockPool.grow` with a `headroom`):
- An admission (a new or resumed request, an import's reservation, and the blocks a
  prefix hit restores from the offload tier) of a tenant with requests running, held
  for export or importing. It must also leave what the tenant's running requests still
  need to finish their prompts (at least a block each) and the rest of its own tokens:
  admitting a prompt whose next chunk could only come from a lighter tenant would just
  move the eviction one step on. Held back by the guard alone (`held_back`), it waits
  without holding up other tenants' requests behind it in the queue.
- A prompt's next chunk while another request of its tenant runs, where anyone's free
  blocks would cover it (`guards_growth`): chunked prompts are how a flood grows, and
  left free they evicted the hot tenant's prefix (docs/history.md, "Cache fairness and
  the chunked flood"). Short, the chunk's request preempts its own tenant's (`gives_way`:
  the lowest class's newest, perhaps itself) instead of evicting a lighter tenant's
  blocks; the preempted request's full blocks stay cached in its tenant's share, so its
  recompute is mostly a prefix hit. That holds back only its tenant, not its class.
- Draft tokens' blocks (`draft_room`): a bet never takes another tenant's cache.
Not guarded: a decode's next block (preempting a live stream, its ITL and its recompute,
to spare a free cached block costs more than the block), and any placement where the
pool is short for everyone: that preempts by class as before (the scheduler's
`_victim`), and the request may take what the preemption frees, whoever's it was.
Progress: a tenant's only running request grows into anyone's blocks, and a tenant with
nothing in flight is admitted into anyone's, so every tenant moves on. With one tenant,
nothing here applies.

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

    def guards_admission(self, req: Request) -> bool:
        """Whether admitting `req` is held to its tenant's share: tenants share the pool
        and its tenant has requests running, held for export or importing."""
        if self.pool.num_tenants < 2:
            return False
        holding = (r for states in self._holding for r in states.values())
        return any(_same_tenant(r, req) for r in (*self._running, *holding))

    def admission_room(self, req: Request, num_tokens: int) -> int | None:
        """Blocks an admission of `req` covering `num_tokens` must leave free for its
        tenant (None: not guarded): what its tenant's running requests still need to
        finish their prompts, at least a block each, and the rest of `req`'s own tokens."""
        if not self.guards_admission(req):
            return None
        mine = (r for r in self._running if _same_tenant(r, req))
        room = max(0, self._blocks(req.num_tokens) - self._blocks(num_tokens))
        return room + sum(max(1, self._blocks(r.num_tokens) - len(r.block_ids)) for r in mine)

    def held_back(self, req: Request, num_tokens: int, room: int | None) -> bool:
        """Whether an admission that just failed was stopped by the guard alone: the
        pool's free blocks, anyone's, would have covered it. Then the requests of other
        tenants behind it may go first; otherwise the pool is short for all."""
        need = self._blocks(num_tokens) - len(req.block_ids)
        return room is not None and need + room <= self.pool.num_free

    def guards_growth(self, req: Request, num_tokens: int) -> bool:
        """Whether placing running `req`'s growth to `num_tokens` is held to its share: a
        prompt chunk (not a decode's block), while another request of its tenant runs,
        where anyone's free blocks would cover it. When the pool is short for everyone
        the placement preempts by class instead, and may take what that frees."""
        if self.pool.num_tenants < 2 or req.num_tokens - req.num_computed_tokens <= 1:
            return False
        need = self._blocks(num_tokens) - len(req.block_ids)
        return need <= self.pool.num_free and self._others_running(req)

    def growth_room(self, req: Request) -> int | None:
        """Within a guarded placement: 0 while another request of `req`'s tenant runs,
        None once `req` is its tenant's only running request (it must progress)."""
        return 0 if self._others_running(req) else None

    def draft_room(self) -> int | None:
        """0 (guarded) for draft tokens' blocks where tenants share the pool, else None."""
        return 0 if self.pool.num_tenants > 1 else None

    def gives_way(self, req: Request, guarded: bool) -> list[int]:
        """Where in `running` the requests that may be preempted for `req`'s growth are:
        its own tenant's in a guarded placement, everyone's otherwise."""
        running = self._running
        if not guarded:
            return list(range(len(running)))
        return [i for i, r in enumerate(running) if _same_tenant(r, req)]

    def _others_running(self, req: Request) -> bool:
        return any(r is not req and _same_tenant(r, req) for r in self._running)

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _same_tenant(a: Request, b: Request) -> bool:
    return a.cache_owner.tenant == b.cache_owner.tenant
