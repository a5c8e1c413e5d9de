"""The WAITING queue: requests waiting for admission, in the order the scheduler admits
them: the highest priority class first, first in first out within a class.

Lifecycle of an entry: `append` puts a new request (or an import whose KV has landed) at
the back of its class; `appendleft` puts a preempted one at the front of its class, ahead
of requests that have not run yet, since it already waited once. The scheduler admits
from the head (`first`, then `popleft`) and `remove`s a request that ends while waiting.
A request's class never changes, so it is always in its own class's lane.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from engine.priority import Priority
from engine.request import Request


class WaitingQueue:
    """One FIFO lane per class; iteration, `first` and `popleft` go highest class first."""

    def __init__(self) -> None:
        self._lanes: dict[Priority, deque[Request]] = {
            p: deque() for p in sorted(Priority, reverse=True)
        }

    def append(self, req: Request) -> None:
        self._lanes[req.priority].append(req)

    def appendleft(self, req: Request) -> None:
        self._lanes[req.priority].appendleft(req)

    def first(self) -> Request:
        """The next request to admit; IndexError when empty."""
        for lane in self._lanes.values():
            if lane:
                return lane[0]
        raise IndexError("the waiting queue is empty")

    def popleft(self) -> Request:
        """Take the next request to admit; IndexError when empty."""
        return self._lanes[self.first().priority].popleft()

    def remove(self, req: Request) -> None:
        """Take `req` out; ValueError if it is not waiting."""
        self._lanes[req.priority].remove(req)

    def count(self, priority: Priority) -> int:
        return len(self._lanes[priority])

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and req in self._lanes[req.priority]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def __bool__(self) -> bool:
        return any(self._lanes.values())

    def __iter__(self) -> Iterator[Request]:
        for lane in self._lanes.values():
            yield from lane

    def __getitem__(self, index: int) -> Request:
        """The request `index` places from the head (for inspection; O(n))."""
        return list(self)[index]
