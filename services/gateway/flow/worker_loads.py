"""Each worker's live load as the site decision reads it, from the workers' signals.

Lifecycle: `Capacity` owns one `WorkerLoads` and hands it every tick's signals
(`update`); the gateway's `SitePolicy` reads it per request (`queue_s`, `streams`,
`long_prompt_lately`) and tells it what it sent where (`placed`, `long_prompt_sent`), and
what it took back (`withdraw`: a prefill attempt that failed, whose stream is placed
again or ends).

- `queue_s`: seconds of prefill waiting on the worker at its last signal (its queued
  prompt tokens over its measured prefill speed; 0 while it has measured none).
- `streams`: requests on the worker (running and waiting at its last signal) plus the
  streams this gateway placed there since that signal was taken: a burst of requests
  inside one signal interval would otherwise all see the same counts and land together.
- `long_prompt_lately`: whether this gateway sent the worker a long prompt's prefill in
  the last `RECENT_WINDOW_S` seconds. Such a worker will likely get the next one too, and
  every stream it decodes would wait through that prefill's chunks. (Signals do not say
  how long the queued prompts are; another gateway's long prompts show only as queue.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # only its fields are read here
    from services.router.worker_signal import WorkerSignal

#: How long a long prompt's prefill marks its worker as a long-prompt worker: a few
#: long prefills' time on the development host, many signal intervals.
RECENT_WINDOW_S = 10.0


class LoadView(Protocol):
    """What the site decision reads of workers' loads (0 / False for an unknown one)."""

    def queue_s(self, worker_id: str) -> float: ...

    def streams(self, worker_id: str) -> int: ...

    def long_prompt_lately(self, worker_id: str) -> bool: ...

    def placed(self, worker_id: str) -> float | None:
        """Count a stream placed on `worker_id`; returns the mark `withdraw` takes (None
        for a worker without a signal, where nothing is counted)."""
        ...

    def withdraw(self, worker_id: str, mark: float) -> None:
        """Uncount the stream `placed` counted as `mark` (nothing if a signal taken
        since already counts it, or the worker is gone)."""
        ...

    def long_prompt_sent(self, worker_id: str) -> None: ...


class NoLoads:
    """No signals: every worker idle (the decision falls back to prompt lengths)."""

    def queue_s(self, worker_id: str) -> float:
        return 0.0

    def streams(self, worker_id: str) -> int:
        return 0

    def long_prompt_lately(self, worker_id: str) -> bool:
        return False

    def placed(self, worker_id: str) -> float | None:
        return None

    def withdraw(self, worker_id: str, mark: float) -> None:
        return None

    def long_prompt_sent(self, worker_id: str) -> None:
        return None


@dataclass
class _Worker:
    signal: WorkerSignal
    taken: float  # when the signal was published, on this gateway's monotonic clock
    placed: list[float] = field(default_factory=list)  # when streams went there since


class WorkerLoads:
    """The live view, on the gateway's monotonic clock (`now`: tests pass their own)."""

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._workers: dict[str, _Worker] = {}
        self._long_sent: dict[str, float] = {}  # worker id -> last long prompt sent

    def update(self, signals: Sequence[WorkerSignal], now: float) -> None:
        """Take a tick's signals; a worker without one is forgotten (gone or silent)."""
        seen: dict[str, _Worker] = {}
        for s in signals:
            taken = now - s.age_s
            old = self._workers.get(s.worker_id)
            placed = [t for t in old.placed if t > taken] if old else []  # the rest counted
            seen[s.worker_id] = _Worker(s, max(taken, old.taken) if old else taken, placed)
        self._workers = seen
        horizon = now - self.window_s
        self._long_sent = {w: t for w, t in self._long_sent.items() if t > horizon}

    def queue_s(self, worker_id: str) -> float:
        w = self._workers.get(worker_id)
        return 0.0 if w is None else w.signal.queue_s

    def streams(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        return w.signal.running + w.signal.waiting + len(w.placed)

    def long_prompt_lately(self, worker_id: str, now: float | None = None) -> bool:
        sent = self._long_sent.get(worker_id)
        now = time.monotonic() if now is None else now
        return sent is not None and now - sent < self.window_s

    def placed(self, worker_id: str, now: float | None = None) -> float | None:
        w = self._workers.get(worker_id)
        if w is None:
            return None
        w.placed.append(time.monotonic() if now is None else now)
        return w.placed[-1]

    def withdraw(self, worker_id: str, mark: float) -> None:
        w = self._workers.get(worker_id)
        if w is not None and mark in w.placed:
            w.placed.remove(mark)

    def long_prompt_sent(self, worker_id: str, now: float | None = None) -> None:
        self._long_sent[worker_id] = time.monotonic() if now is None else now
