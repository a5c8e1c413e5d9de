"""When a worker's home role should change: a decision on the cluster's load signals.

The worker's `HomeRole` task (`home_role.py`) reads every worker's signal each tick and
hands it to `RolePlanner.observe`; `want(now)` then says which role this worker should
move to, or None. A sample's lean (`lean`) is where that one reading points; a move needs
the lean to hold across a whole `window_s`, because a burst is not a shift of the mix.

The two moves:
- **prefill -> decode** (the prefill pool has room to spare): at every sample of the
  window this worker had served no new Prefill call (no prompt took the hop to it), its
  own queue was under `IDLE_QUEUE_S`, and the decode pool carried at least
  `MIN_DECODE_STREAMS` streams per worker. Chat-shaped traffic then runs on one more
  decode worker, each prefilling its short prompts itself, as colocated workers do.
- **decode -> prefill** (prompts wait to be prefilled): in at least `PREFILL_SHARE` of
  the window's samples, and in the latest, long prompts were queued on the decode pool
  (its queued prompt tokens per waiting request at least `long_prompt_tokens`) while no
  prefill worker had room (there is none, or every one's queue is over `BUSY_QUEUE_S`);
  the decode pool keeps at least one other worker; and this worker carries the fewest
  streams of the decode pool (ties: the lowest id), so the decode workers agree on who
  moves. A stricter rule one way than the other is deliberate: a single hop proves the
  prefill pool is used, while queued long prompts come and go between samples.

Missing evidence never moves a worker: a tick without a reading (Redis down) starts
the window over (`HomeRole` resets the planner), so a move always rests on a whole
window of readings; a reading without this worker's own signal leans nowhere, and a
signal that expired (its worker stopped publishing) is not in the reading at all. A
mixed worker never moves (a colocated cluster has no split to bend).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.role import Role
from services.router.worker_signal import IDLE_QUEUE_S, MIN_DECODE_STREAMS, WorkerSignal

#: A prefill worker's queue over this many seconds leaves it no room for more prompts.
BUSY_QUEUE_S = 2.0
#: The share of a window's samples that must lean to prefill for a decode worker to move.
PREFILL_SHARE = 0.5


@dataclass(frozen=True)
class Reading:
    """One tick's view: every live worker's signal, and this worker's Prefill calls so
    far (a counter: a change between readings means prompts took the hop to it)."""

    at: float  # monotonic seconds
    signals: Sequence[WorkerSignal]
    prefill_calls: int


def _streams(s: WorkerSignal) -> int:
    return s.running + s.waiting


def _long_prompts_waiting(decode: Sequence[WorkerSignal], long_prompt_tokens: int) -> bool:
    queued = sum(s.queued_tokens for s in decode)
    waiting = sum(s.waiting for s in decode)
    # A prompt still prefilling counts as running, not waiting; max(1, ...) keeps one such
    # long prompt (its tokens alone over the bar) counting as long.
    return queued > 0 and queued / max(1, waiting) >= long_prompt_tokens


def lean(
    worker_id: str, role: Role, reading: Reading, hopped: bool, long_prompt_tokens: int
) -> Role | None:
    """Where one reading points `worker_id` (home role `role`): the other role, or None.
    `hopped` says whether it served a Prefill call since the previous reading."""
    mine = next((s for s in reading.signals if s.worker_id == worker_id), None)
    if mine is None:
        return None
    prefill = [s for s in reading.signals if s.role is Role.PREFILL]
    decode = [s for s in reading.signals if s.role is Role.DECODE]
    if role is Role.PREFILL:
        loaded = decode and sum(map(_streams, decode)) >= MIN_DECODE_STREAMS * len(decode)
        idle = not hopped and mine.queue_s < IDLE_QUEUE_S
        return Role.DECODE if loaded and idle else None
    if role is Role.DECODE and len(decode) >= 2:
        no_room = all(s.queue_s > BUSY_QUEUE_S for s in prefill)
        donor = min(decode, key=lambda s: (_streams(s), s.worker_id)).worker_id == worker_id
        if no_room and donor and _long_prompts_waiting(decode, long_prompt_tokens):
            return Role.PREFILL
    return None


class RolePlanner:
    """The leans of the last `window_s` seconds of one worker, and the move they call for."""

    def __init__(self, worker_id: str, window_s: float, long_prompt_tokens: int) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.worker_id = worker_id
        self.window_s = window_s
        self.long_prompt_tokens = long_prompt_tokens
        self._leans: deque[tuple[float, Role | None]] = deque()
        self._calls: int | None = None  # prefill_calls at the previous reading

    def observe(self, role: Role, reading: Reading) -> None:
        hopped = self._calls is not None and reading.prefill_calls != self._calls
        self._calls = reading.prefill_calls
        where = lean(self.worker_id, role, reading, hopped, self.long_prompt_tokens)
        self._leans.append((reading.at, where))
        # Keep the newest sample at or before the window's start: it proves coverage.
        while len(self._leans) > 1 and self._leans[1][0] <= reading.at - self.window_s:
            self._leans.popleft()

    def want(self, role: Role, now: float) -> Role | None:
        """The role to move to now, or None (the window is not covered yet, or the
        leans do not agree enough)."""
        if not self._leans or self._leans[0][0] > now - self.window_s:
            return None
        leans = [where for _, where in self._leans]
        if role is Role.PREFILL and all(w is Role.DECODE for w in leans):
            return Role.DECODE
        if role is Role.DECODE and leans[-1] is Role.PREFILL:
            share = sum(w is Role.PREFILL for w in leans) / len(leans)
            if share >= PREFILL_SHARE:
                return Role.PREFILL
        return None

    def reset(self) -> None:
        """Forget the leans (after a move: the next needs a window of its own)."""
        self._leans.clear()
