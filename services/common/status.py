"""pdserve's typed errors and the one table of their gRPC statuses, used by every server.

Lifecycle of an error: a component raises a typed error (the engine's and kvtransfer's
live with them; the ones the services raise are defined here, so that this module can
name them without importing the layers above). A server that answers a call with it
looks its status up here: `status_for(exc)` gives the code and a message a user can act
on, `abort_with(context, exc)` ends the call with them. The gateway's HTTP API maps the
same code onto an HTTP status (`services.gateway.openai.schema.http_for_status`), so one
error gets one answer on both front doors.

`STATUS` is the table: an error class maps to its code, and a subclass without its own
row takes its nearest ancestor's. `StatusError` is the one kind whose code is a value,
not a type: a status a peer answered with, passed on (or a deadline the gateway enforces
on a peer). Anything else is INTERNAL, with its type in the message.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import grpc

from engine.errors import (
    AdapterFormatError,
    AdaptersBusyError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    OutOfBlocksError,
    UnknownAdapterError,
    UnknownRequestError,
)
from kvtransfer.errors import (
    InvalidHandleError,
    KvCorruptionError,
    LayoutMismatchError,
    LeaseExpiredError,
    NoBlocksError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)

Code = grpc.StatusCode


class ServiceError(Exception):
    """Base of the errors the services raise on purpose; `code` reads `STATUS`."""

    @property
    def code(self) -> grpc.StatusCode:
        return code_for(self)


class UnknownModelError(ServiceError, LookupError):
    """The request names a model this gateway does not serve (NOT_FOUND, HTTP 404)."""


class AuthError(ServiceError):
    """No valid API key (UNAUTHENTICATED, HTTP 401)."""

    @property
    def denied(self) -> bool:
        """True for a valid key without the right (`PermissionDeniedError`)."""
        return False


class PermissionDeniedError(AuthError):
    """A valid API key without the right to the call (PERMISSION_DENIED, HTTP 403)."""

    @property
    def denied(self) -> bool:
        return True


class RefusalReason(enum.StrEnum):
    """Why the gateway said no before any worker did work (the metrics' `reason` label)."""

    QUOTA = "quota"  # the tenant's tokens for this minute are used
    STREAM_CAP = "stream_cap"  # --max-streams streams already run on this gateway
    ROOM_FULL = "room_full"  # the waiting room is full of requests of this class or higher
    DISPLACED = "displaced"  # a higher class took this request's waiting-room place
    BUDGET = "budget"  # it waited its class's whole TTFT budget without capacity


class Refusal(ServiceError):
    """A request refused at admission, with a retry hint: `retry_after_s` becomes the
    HTTP `Retry-After` header and the gRPC `retry-after-ms` trailing metadata."""

    def __init__(self, message: str, reason: RefusalReason, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = max(0.0, retry_after_s)


class QuotaExceeded(Refusal):
    """The tenant used its tokens for this minute (RESOURCE_EXHAUSTED, HTTP 429);
    `retry_after_s` is the time left in the window."""

    def __init__(self, tenant: str, limit: int, retry_after_s: float) -> None:
        super().__init__(
            f"tokens_per_minute: tenant {tenant!r} used its {limit} tokens for this minute; "
            f"retry in {retry_after_s:.1f}s",
            RefusalReason.QUOTA,
            retry_after_s,
        )


class StreamCapReached(Refusal):
    """This gateway already runs --max-streams streams (RESOURCE_EXHAUSTED, HTTP 429)."""


class Overloaded(Refusal):
    """The cluster cannot start the request within its class's TTFT budget, and the
    waiting room cannot hold it any longer (UNAVAILABLE, HTTP 503)."""


class NoWorkerError(ServiceError):
    """No eligible worker is left for this request (UNAVAILABLE, HTTP 503)."""


class ModelMismatchError(NoWorkerError):
    """The workers' model differs from the gateway's copy in a part the gateway uses (its
    tokenizer, chat template or config): it could only send them wrong tokens
    (UNAVAILABLE, HTTP 503: an operator's fix, and another gateway may be right)."""


class RolloutConflict(ServiceError):
    """A rollout is not in the phase a change needs: one runs already, or none does
    (FAILED_PRECONDITION)."""


class NoRolloutsError(ServiceError):
    """The model cannot have a rollout: it is unnamed, or there is no Redis
    (FAILED_PRECONDITION)."""


class DecodeFullError(ServiceError):
    """A decode worker's KV pool had no room for a request's imported KV within the wait
    it allows (RESOURCE_EXHAUSTED): nothing is held there, and the prefill worker still
    holds the KV, so the gateway places the decode side again (`services/decode/`)."""


class IncompatibleWorkerError(ServiceError):
    """A worker's model, KV layout or role conflicts with the cluster's registry
    (FAILED_PRECONDITION: the worker must not serve)."""


class StatusError(Exception):
    """An error whose status is a value: a peer's status passed on, or a deadline."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


#: The one mapping from error class to gRPC status. Subclasses inherit their ancestor's
#: row unless they have their own (LayoutMismatchError is an InvalidHandleError).
STATUS: Final[Mapping[type[BaseException], grpc.StatusCode]] = MappingProxyType(
    {
        # engine
        InvalidRequestError: Code.INVALID_ARGUMENT,
        ModelNotFoundError: Code.NOT_FOUND,
        OutOfBlocksError: Code.RESOURCE_EXHAUSTED,
        UnknownRequestError: Code.NOT_FOUND,
        DeadlineExceededError: Code.DEADLINE_EXCEEDED,
        # A worker without an adapter its gateway lists, a broken adapter, or two copies
        # that differ: the operator's deployment to fix (the gateway answers an adapter
        # it does not list itself, NOT_FOUND, before any worker is asked).
        UnknownAdapterError: Code.FAILED_PRECONDITION,
        AdapterFormatError: Code.FAILED_PRECONDITION,
        AdaptersBusyError: Code.RESOURCE_EXHAUSTED,
        # kvtransfer
        TransferError: Code.INTERNAL,
        InvalidHandleError: Code.INVALID_ARGUMENT,
        LayoutMismatchError: Code.INVALID_ARGUMENT,
        PeerUnavailableError: Code.UNAVAILABLE,
        TransferTimeoutError: Code.DEADLINE_EXCEEDED,
        LeaseExpiredError: Code.NOT_FOUND,
        KvCorruptionError: Code.DATA_LOSS,
        NoBlocksError: Code.RESOURCE_EXHAUSTED,
        # services
        UnknownModelError: Code.NOT_FOUND,
        AuthError: Code.UNAUTHENTICATED,
        PermissionDeniedError: Code.PERMISSION_DENIED,
        Refusal: Code.UNAVAILABLE,
        QuotaExceeded: Code.RESOURCE_EXHAUSTED,
        StreamCapReached: Code.RESOURCE_EXHAUSTED,
        Overloaded: Code.UNAVAILABLE,
        NoWorkerError: Code.UNAVAILABLE,
        DecodeFullError: Code.RESOURCE_EXHAUSTED,
        IncompatibleWorkerError: Code.FAILED_PRECONDITION,
        RolloutConflict: Code.FAILED_PRECONDITION,
        NoRolloutsError: Code.FAILED_PRECONDITION,
    }
)


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status `exc` ends a call with: its row in `STATUS` (or its nearest
    ancestor's), a `StatusError`'s own code, else INTERNAL."""
    if isinstance(exc, StatusError):
        return exc.code
    for cls in type(exc).__mro__:
        code = STATUS.get(cls)
        if code is not None:
            return code
    return Code.INTERNAL


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and the message to end a call with."""
    code = code_for(exc)
    if isinstance(exc, OutOfBlocksError):
        return code, f"no KV blocks free: {exc}"
    if code == Code.INTERNAL and not isinstance(exc, StatusError | TransferError):
        return code, f"{type(exc).__name__}: {exc}"  # a bug or an untyped failure: say what
    return code, str(exc)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with `exc`'s status (raises, as `context.abort` does)."""
    code, message = status_for(exc)
    await context.abort(code, message)
