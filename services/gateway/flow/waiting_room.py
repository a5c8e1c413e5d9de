"""The gateway's waiting room: requests that cannot start yet, ordered by class and
fairness, each for at most its class's TTFT budget.

Lifecycle of a `Ticket`: the admission controller (`services.gateway.flow.admission`) makes
one for a request that cannot start at once and `offer`s it. The room is bounded: when
it is full, a newcomer of a higher class displaces the newest ticket of the lowest class
present (so `critical` is never refused while a lower class holds a place), and
otherwise the newcomer itself is turned away; `offer` returns whichever ticket must be
refused. On every tick the controller drops what `expired` returns (waited their whole
budget: refused) and asks `pick` for the next ticket to start, until it says none.

Order: a higher class always goes first. Within a class, tenants share by deficit round
robin (DRR) in KV-cache-block-seconds, the resource that binds: each visit to a
backlogged tenant adds `quantum x weight` to its deficit, and its oldest ticket starts
when its estimated charge fits the deficit, so over time each tenant starts work in
proportion to its weight whatever the size of its requests. A tenant the cluster-wide
ledger says is over its share (`held`) gets no quantum while it is held: its share is
being taken on another gateway replica. Nobody starves: the ledger ages (attained
service decays), a held tenant is released as soon as the tenants it yields to catch up
or stop waiting, and only tenants with a ticket that can still start count as waiting.

Pure data structure, no clock and no I/O: callers pass `now` (time.monotonic()).
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.priority import Priority
from services.gateway.flow.capacity import Cost

NO_COST = Cost(0, 0)


@dataclass(eq=False)
class Ticket:
    """One waiting request. `charge` is its estimated KV-block-seconds (what DRR bills)."""

    priority: Priority
    tenant: str
    weight: float
    charge: float
    arrived: float  # time.monotonic() when it asked to be admitted
    budget_s: float  # its class's TTFT budget: the longest it may wait
    cost: Cost = NO_COST  # what it asks of the cluster (the capacity check's input)
    seq: int = field(default_factory=itertools.count().__next__)

    def waited(self, now: float) -> float:
        return now - self.arrived

    def expired(self, now: float) -> bool:
        return self.waited(now) >= self.budget_s


class _ClassQueue:
    """One class's tickets: a FIFO per tenant, the DRR ring of backlogged tenants."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[Ticket]] = {}
        self.ring: deque[str] = deque()  # backlogged tenants, the next one to visit first
        self.deficit: dict[str, float] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def tickets(self) -> Iterator[Ticket]:
        for q in self.queues.values():
            yield from q

    def add(self, ticket: Ticket) -> None:
        q = self.queues.get(ticket.tenant)
        if q is None:
            q = self.queues[ticket.tenant] = deque()
            self.ring.append(ticket.tenant)
            self.deficit[ticket.tenant] = 0.0
        q.append(ticket)

    def remove(self, ticket: Ticket) -> None:
        q = self.queues[ticket.tenant]
        q.remove(ticket)
        if not q:  # an idle tenant keeps no credit (DRR: its deficit resets)
            del self.queues[ticket.tenant]
            del self.deficit[ticket.tenant]
            self.ring.remove(ticket.tenant)

    def pick(
        self, now: float, held: Callable[[str], bool], doomed: Callable[[Ticket], bool]
    ) -> Ticket | None:
        """The ticket DRR starts next, charged to its tenant's deficit; None if every
        backlogged tenant is held or has only doomed tickets. A tenant's candidate is
        its oldest ticket that is not doomed."""
        heads = {}
        for tenant, q in self.queues.items():
            head = next((t for t in q if not doomed(t)), None)
            if head is not None and not held(tenant):
                heads[tenant] = head
        if not heads:
            return None
        # One visit must be able to pay for any head: then two turns of the ring suffice.
        quantum = max(h.charge / h.weight for h in heads.values())
        for _ in range(2 * len(self.ring) + 1):
            tenant = self.ring[0]
            head = heads.get(tenant)
            if head is not None and head.charge <= self.deficit[tenant]:
                self.deficit[tenant] -= head.charge
                return head
            if head is not None:
                self.deficit[tenant] += quantum * head.weight
            self.ring.rotate(-1)
        raise AssertionError("DRR: a full quantum did not pay for any head")


class WaitingRoom:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"waiting room capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._classes = {p: _ClassQueue() for p in Priority}

    def __len__(self) -> int:
        return sum(len(c) for c in self._classes.values())

    def count(self, priority: Priority) -> int:
        return len(self._classes[priority])

    def tickets(self) -> Iterator[Ticket]:
        for p in sorted(Priority, reverse=True):
            yield from self._classes[p].tickets()

    def waiting_at_or_above(self, priority: Priority) -> int:
        """Tickets a request of `priority` would wait behind (its class and higher)."""
        return sum(len(self._classes[p]) for p in Priority if p >= priority)

    def tenants(
        self, priority: Priority, viable: Callable[[Ticket], bool] = lambda t: True
    ) -> list[str]:
        """Tenants with a `viable` ticket waiting in `priority`."""
        queues = self._classes[priority].queues
        return [tenant for tenant, q in queues.items() if any(viable(t) for t in q)]

    def offer(self, ticket: Ticket) -> Ticket | None:
        """Seat `ticket`; returns the ticket to refuse (it, or one it displaced), if any."""
        if len(self) < self.capacity:
            self._classes[ticket.priority].add(ticket)
            return None
        victim = self._displaceable(ticket.priority)
        if victim is None:
            return ticket
        self.remove(victim)
        self._classes[ticket.priority].add(ticket)
        return victim

    def _displaceable(self, priority: Priority) -> Ticket | None:
        """The newest ticket of the lowest class below `priority`, if any."""
        for p in sorted(Priority):
            if p >= priority:
                return None
            tickets = list(self._classes[p].tickets())
            if tickets:
                return max(tickets, key=lambda t: t.seq)
        return None

    def remove(self, ticket: Ticket) -> None:
        self._classes[ticket.priority].remove(ticket)

    def expired(self, now: float) -> list[Ticket]:
        """Remove and return the tickets that waited their whole budget."""
        out = [t for t in self.tickets() if t.expired(now)]
        for t in out:
            self.remove(t)
        return out

    def pick(
        self,
        now: float,
        fits: Callable[[Ticket], bool],
        held: Callable[[Priority, str], bool] = lambda p, t: False,
        doomed: Callable[[Ticket], bool] = lambda t: False,
    ) -> Ticket | None:
        """Remove and return the next ticket to start, or None.

        Classes go highest first. Within one, DRR picks the ticket; if capacity says it
        cannot start (`fits`), nothing starts: no lower class, no smaller request jumps
        the queue (it would starve the large one). A class whose backlogged tenants are
        all `held` (over their cluster-wide share) is passed over. A
        `doomed` ticket (it has waited longer than admission lets it: even an idle
        cluster could not start it in time now) is passed over too, and left to be
        refused at its budget: it must not block the ones behind it that still can.
        """
        for p in sorted(Priority, reverse=True):
            queue = self._classes[p]
            if not queue.queues:
                continue
            ticket = queue.pick(now, functools.partial(held, p), doomed)
            if ticket is None:
                continue
            if not fits(ticket):
                queue.deficit[ticket.tenant] += ticket.charge  # not started: keep its credit
                return None
            queue.remove(ticket)
            return ticket
        return None
