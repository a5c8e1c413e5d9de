"""Each worker's live load as the site decision reads it, from the workers' signals.

Lifecycle: `Capacity` owns one `WorkerLoads` and hands it every tick's signals
(`update`); the gateway's `SitePolicy` reads it per request (`queue_s`,
`recent_queue_s`, `streams`) and tells it where it placed a stream (`placed`).

- `queue_s`: seconds of prefill waiting on the worker at its last signal (its queued
  prompt tokens over its measured prefill speed; 0 while it has measured none).
- `recent_queue_s`: the same, smoothed over the last `RECENT_WINDOW_S` seconds. A prefill
  worker between two long prompts has an empty queue for a moment; what says whether it
  has room to decode is how busy it has been lately, not that moment.
- `streams`: requests on the worker (running and waiting at its last signal) plus the
  streams this gateway placed there since that signal was taken: a burst of requests
  inside one signal interval would otherwise all see the same counts and land together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # only its fields are read here
    from services.router.worker_signal import WorkerSignal

#: How far back `recent_queue_s` looks (the smoothing's time constant): several of a
#: long prompt's prefills, many signal intervals.
RECENT_WINDOW_S = 5.0


class LoadView(Protocol):
    """What the site decision reads of one worker's load (0 for an unknown worker)."""

    def queue_s(self, worker_id: str) -> float: ...

    def recent_queue_s(self, worker_id: str) -> float: ...

    def streams(self, worker_id: str) -> int: ...

    def placed(self, worker_id: str) -> None: ...


class NoLoads:
    """No signals: every worker idle (the decision falls back to prompt lengths)."""

    def queue_s(self, worker_id: str) -> float:
        return 0.0

    def recent_queue_s(self, worker_id: str) -> float:
        return 0.0

    def streams(self, worker_id: str) -> int:
        return 0

    def placed(self, worker_id: str) -> None:
        return None


@dataclass
class _Worker:
    signal: WorkerSignal
    taken: float  # when the signal was published, on this gateway's monotonic clock
    recent_queue_s: float
    placed: list[float] = field(default_factory=list)  # when streams went there since


class WorkerLoads:
    """The live view, on the gateway's monotonic clock (`now`: tests pass their own)."""

    def __init__(self, window_s: float = RECENT_WINDOW_S) -> None:
        self.window_s = window_s
        self._workers: dict[str, _Worker] = {}

    def update(self, signals: Sequence[WorkerSignal], now: float) -> None:
        """Take a tick's signals; a worker without one is forgotten (gone or silent)."""
        seen: dict[str, _Worker] = {}
        for s in signals:
            taken = now - s.age_s
            queue = _queue_s(s)
            old = self._workers.get(s.worker_id)
            if old is None:
                seen[s.worker_id] = _Worker(s, taken, queue)
                continue
            weight = 1.0 - math.exp(-max(0.0, taken - old.taken) / self.window_s)
            recent = old.recent_queue_s + weight * (queue - old.recent_queue_s)
            placed = [t for t in old.placed if t > taken]  # the signal counts the rest
            seen[s.worker_id] = _Worker(s, max(taken, old.taken), recent, placed)
        self._workers = seen

    def queue_s(self, worker_id: str) -> float:
        w = self._workers.get(worker_id)
        return _queue_s(w.signal) if w is not None else 0.0

    def recent_queue_s(self, worker_id: str) -> float:
        w = self._workers.get(worker_id)
        return w.recent_queue_s if w is not None else 0.0

    def streams(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        return w.signal.running + w.signal.waiting + len(w.placed)

    def placed(self, worker_id: str, now: float | None = None) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            w.placed.append(time.monotonic() if now is None else now)


def _queue_s(signal: WorkerSignal) -> float:
    if signal.prefill_tokens_per_s <= 0:
        return 0.0
    return signal.queued_tokens / signal.prefill_tokens_per_s
