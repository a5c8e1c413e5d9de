"""Where to decode next when a decode worker refuses a request before its first chunk,
and until when.

Lifecycle: `StreamRecovery` starts one `DecodeRetry` as it opens the request's first
Decode call (`DecodeRetry.start`). Every attempt waits for its first chunk until
`first_token_deadline`: `--first-token-timeout-s` runs from the first Decode call, across
retries. A call that fails before its first chunk with a status in `REFUSALS` is
reported with `refused(worker_id, refusal)`, and the stream places the decode side
again, excluding `exclude()`:

- FULL (RESOURCE_EXHAUSTED: the worker's KV pool had no room within its own wait): it may
  have room later. When every worker left is full, the placement finds none; the stream
  sleeps `backoff(now)` and calls `retry_full()`, which forgets them, so the next round
  tries them again (a single decode worker is retried this way).
- GONE (UNAVAILABLE: the worker cannot be reached): never again for this request. When
  only such workers are left, the request fails with the last one's status.

Nothing decoded before the first chunk, and the prefill worker still holds the KV under
its lease, so any decode worker may take the request over. `open(now)` says whether a new
attempt may start: before the first-token deadline, and while the KV lease has more than
`LEASE_MARGIN_S` left (a new import must read before it expires). Past that the request
fails with DEADLINE_EXCEEDED, and `window_message` names the bound that ran out. (The
lease's expiry is the prefill host's Unix time: hosts' clocks are assumed to agree to
well within the margin.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

import grpc

from pdserve.v1 import common_pb2

BACKOFF_S = 0.25  # between rounds over decode workers that were all full
LEASE_MARGIN_S = 2.0  # the KV lease must have this left for a new attempt to start


class DecodeRefusal(enum.Enum):
    FULL = "full"  # no room for the KV there now; maybe later
    GONE = "gone"  # unreachable; not tried again


#: The statuses of a Decode call that failed before its first chunk that another
#: attempt may cure. Anything else (a bad handle, an expired lease, a deadline) ends it.
REFUSALS: Final = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: DecodeRefusal.FULL,
    grpc.StatusCode.UNAVAILABLE: DecodeRefusal.GONE,
}


@dataclass
class DecodeRetry:
    first_token_deadline: float  # monotonic: every attempt's first chunk is due by then
    retry_until: float  # monotonic: no attempt starts after this
    first_token_timeout_s: float
    backoff_s: float = BACKOFF_S
    full: set[str] = field(default_factory=set)  # worker ids, forgotten each round
    gone: set[str] = field(default_factory=set)  # worker ids, for good
    attempts: int = 1

    @classmethod
    def start(
        cls,
        first_token_timeout_s: float,
        handle: common_pb2.KvHandle | None,
        now: float,
        wall_now: float,
    ) -> DecodeRetry:
        """At the first Decode call: `now` monotonic, `wall_now` Unix seconds (the KV
        lease's expiry is a Unix time); `handle` is None for a mixed request."""
        deadline = now + first_token_timeout_s
        until = deadline
        if handle is not None and handle.lease_expiry_unix_ms:
            lease_left = handle.lease_expiry_unix_ms / 1000 - wall_now
            until = min(until, now + lease_left - LEASE_MARGIN_S)
        return cls(deadline, until, first_token_timeout_s)

    def refused(self, worker_id: str, refusal: DecodeRefusal) -> None:
        (self.full if refusal is DecodeRefusal.FULL else self.gone).add(worker_id)
        self.attempts += 1

    def exclude(self) -> list[str]:
        return sorted(self.full | self.gone)

    def open(self, now: float) -> bool:
        return now < self.retry_until

    def can_wait(self) -> bool:
        """Whether a worker that refused may take the request later (it was full)."""
        return bool(self.full)

    def backoff(self, now: float) -> float:
        return max(0.0, min(self.backoff_s, self.retry_until - now))

    def retry_full(self) -> None:
        self.full.clear()

    def window_message(self, last: str) -> str:
        """Why the request ends (DEADLINE_EXCEEDED) once no attempt may start; `last` is
        the last refusal."""
        if self.retry_until < self.first_token_deadline:
            why = (
                "kv_lease_ttl_s: the prefill worker's KV lease ran out before a decode "
                "worker had room"
            )
        else:
            why = (
                f"first_token_timeout_s: no decode worker took the request within "
                f"{self.first_token_timeout_s:g}s"
            )
        return f"{why} (last: {last})"
