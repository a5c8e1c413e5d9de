"""How a stream ends with an error, and the request deadline that can end it.

Lifecycle: `RequestStream` and its `StreamRecovery` raise these while a request streams;
`GatewayService.stream` lets them out to its front door, which ends the client's call
with the status. A `WorkerLost`, `KvLost` or `DecodeRefused` is first offered to
`StreamRecovery`, which may cure it (move the stream, prefill again, place another
decode worker) or raise it as the status that ends the stream. Every wait is cut to the
request's `Deadline`; one that runs past it ends the stream with DEADLINE_EXCEEDED
naming `request_deadline_s`, never a retry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from services.common.status import StatusError
from services.gateway.stream.decode_retry import DecodeRefusal


class StreamError(StatusError):
    """Ends the client's stream with this gRPC status (a worker's, or a deadline)."""


class WorkerLost(StreamError):
    """The decode worker died (UNAVAILABLE, or its stream ended early) or sent no token
    within its deadline. After tokens went out, another decode worker may take the
    stream over (`StreamRecovery.after_loss`); otherwise the stream ends with this status."""


class KvLost(StreamError):
    """The decode worker could not import the prefilled KV before its first chunk
    (NOT_FOUND: the lease ended before or during the read, or the prefill worker
    restarted; DATA_LOSS: blocks failed their checksum twice): the bytes were discarded,
    and the same decode worker may prefill the prompt itself (`StreamRecovery.after_loss`)."""


class DecodeRefused(StreamError):
    """A decode worker refused the request before its first chunk (`REFUSALS`): another
    attempt may take it over. Ends the stream with its status when none can."""

    def __init__(self, code: grpc.StatusCode, message: str, refusal: DecodeRefusal) -> None:
        super().__init__(code, message)
        self.refusal = refusal


def deadline_error(deadline_s: float) -> StreamError:
    return StreamError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"request_deadline_s: the request ran past its {deadline_s:g}s deadline",
    )


@dataclass(frozen=True)
class Deadline:
    """A request's total deadline: `at` (monotonic), set `deadline_s` after it started."""

    at: float
    deadline_s: float  # `request_deadline_s`, which the error names

    def left(self) -> float:
        """Seconds left before the deadline; DEADLINE_EXCEEDED once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def error(self) -> StreamError:
        return deadline_error(self.deadline_s)
