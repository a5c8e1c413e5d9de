"""One step's work, as the scheduler hands it to the model runner.

Lifecycle: `Scheduler.schedule()` builds a fresh batch each step. Running requests are
`add`ed as they are placed (a decode's one token, or a prefill chunk), and `drop`ped again
when a later placement in the same step has to preempt them; admitted requests are added
last. The runner executes `items`, the engine advances each and reports `expired`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledBatch:
    """Decodes (one new token each) first, then prefill chunks `(request, tokens)`.

    `preempted` lists the requests preempted this step. `expired` lists those that ended
    with DEADLINE this step instead of being recomputed (blocks freed): preempted ones
    past their deadline, and earlier-preempted ones whose deadline passed while they
    waited. The engine reports them as finished outputs. `dry`: a preemption this step
    was for want of blocks, so nothing is admitted; `held_back`: tenants whose request
    gave way to their share of the cache (engine/cache_guard.py), admitted no further.
    """

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)
    dry: bool = False
    held_back: set[str] = field(default_factory=set)

    @property
    def items(self) -> list[tuple[Request, int]]:
        return [(r, 1) for r in self.decodes] + self.prefills

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def add(self, req: Request, n: int) -> None:
        """Schedule `n` tokens of `req` (n == 1: a decode, or a one-token chunk)."""
        if n == 1:
            self.decodes.append(req)
        else:
            self.prefills.append((req, n))

    def drop(self, req: Request) -> None:
        """Take a request placed earlier this step back out (it was preempted)."""
        self.decodes = [r for r in self.decodes if r is not req]
        self.prefills = [(r, k) for r, k in self.prefills if r is not req]
