"""Priority classes on the wire: `engine.priority.Priority` <-> the proto `Priority` enum.

Lifecycle of a request's class (and of its deadline, which travels beside it): the
gateway reads what the client asked for (`GenerateRequest.priority` via `from_proto`, or
the HTTP header via `Priority.parse`), resolves it against the caller's API key, and
sends the result to the workers in `PrefillRequest.priority` / `DecodeRequest.priority`
(`to_proto`); each worker hands it to its engine (`for_engine`). The proto enum keeps 0
for "unspecified", so its values are the engine's plus one. The deadline needs no field:
it is each worker call's gRPC deadline, which a worker turns into its engine's
(`engine_deadline(context.time_remaining())`).
"""

from __future__ import annotations

import time

from engine.errors import InvalidRequestError
from engine.priority import Priority
from pdserve.v1 import common_pb2

UNSPECIFIED = common_pb2.PRIORITY_UNSPECIFIED


def to_proto(priority: Priority) -> common_pb2.Priority.ValueType:
    return common_pb2.Priority.ValueType(int(priority) + 1)


def from_proto(value: int, field: str = "priority") -> Priority | None:
    """The class a proto value names; None for UNSPECIFIED. A value no class has (proto3
    enums are open: a newer or broken client can send any number) is INVALID_ARGUMENT
    naming `field` and the allowed names."""
    if value == UNSPECIFIED:
        return None
    try:
        return Priority(value - 1)
    except ValueError:
        allowed = ", ".join(p.label for p in Priority)
        raise InvalidRequestError(field, f"must be one of {allowed}", value) from None


def for_engine(value: int) -> Priority:
    """What a worker runs a request at: the class the gateway sent, STANDARD if none
    (or one this worker does not know: a worker never refuses a request for its class)."""
    try:
        sent = from_proto(value)
    except InvalidRequestError:
        return Priority.STANDARD
    # Not `from_proto(value) or STANDARD`: SHEDDABLE is 0, so falsy.
    return Priority.STANDARD if sent is None else sent


def engine_deadline(time_remaining_s: float | None) -> float | None:
    """The engine's `deadline` (on this process's `time.monotonic()`) for a call with
    `time_remaining_s` left before its gRPC deadline (None: no deadline)."""
    return None if time_remaining_s is None else time.monotonic() + time_remaining_s
