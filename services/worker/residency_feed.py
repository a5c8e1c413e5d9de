"""A worker's prefix cache, reported to the router: a snapshot, then what changed.

Lifecycle: the worker builds one `ResidencyFeed(board, engine.residency, worker_id,
incarnation)` and hands it to its `SignalPublisher`, which calls `publish` right after
each load signal (so the index is as fresh as the signal: one `--signal-interval-s`).
The first call, and the first after any failure, sends a snapshot of every hash the
engine holds (`ResidencyBoard.reset`), which also replaces what an earlier process of
the same worker id left there; every later call sends the changes since the previous
one (`apply`). If Redis says the set is gone or not ours (it expired, Redis restarted
or failed over), the same call sends a snapshot at once. `withdraw` removes the set on
a clean shutdown.

Blocking (Redis round trips): call it from a thread, as the publisher does. Redis errors
propagate; the changes drained for a failed call are not lost, because the next call
sends a whole snapshot.
"""

from __future__ import annotations

from engine.residency import ResidencyLog
from services.router.residency import ResidencyBoard


class ResidencyFeed:
    """Keeps one worker's `ns:resident:<id>` equal to its engine's `ResidencyLog`."""

    def __init__(
        self, board: ResidencyBoard, log: ResidencyLog, worker_id: str, incarnation: str
    ) -> None:
        if not incarnation:
            raise ValueError("incarnation must be non-empty (the registration's)")
        self.board = board
        self.log = log
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.snapshots = 0  # snapshots sent: 1 after a clean start, more after failures
        self._synced = False  # the set in Redis equals the log as of the last drain

    def publish(self) -> None:
        """Bring the reported set up to date (one round trip, two after a loss)."""
        if self._synced:
            delta = self.log.drain()
            self._synced = False  # until Redis confirms: a failure below resyncs
            if self.board.apply(self.worker_id, self.incarnation, delta.added, delta.removed):
                self._synced = True
                return
        self.board.reset(self.worker_id, self.incarnation, self.log.snapshot())
        self.snapshots += 1
        self._synced = True

    def withdraw(self) -> None:
        """Remove the reported set (the worker stops serving)."""
        self._synced = False
        self.board.withdraw(self.worker_id)
