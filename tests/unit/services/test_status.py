"""The one table of gRPC statuses: every typed error gets its code there (a subclass its
ancestor's unless it has its own row), a passed-on status keeps its code, anything else
is INTERNAL naming its type; the gateway's HTTP API answers from the same code."""

from __future__ import annotations

import grpc
import pytest

from engine.errors import InvalidRequestError, ModelNotFoundError, OutOfBlocksError
from kvtransfer import errors as kv
from services.common.status import (
    STATUS,
    AuthError,
    IncompatibleWorkerError,
    NoWorkerError,
    PermissionDeniedError,
    QuotaExceeded,
    StatusError,
    UnknownModelError,
    code_for,
    status_for,
)
from services.gateway.openai.schema import http_for_status
from services.router.placement import NoWorkerError as PlacementNoWorkerError
from services.router.registry import IncompatibleWorkerError as RegistryIncompatible

Code = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "code", "http"),
    [
        (InvalidRequestError("prompt", "must not be empty"), Code.INVALID_ARGUMENT, 400),
        (ModelNotFoundError("no model"), Code.NOT_FOUND, 404),
        (OutOfBlocksError("need 3"), Code.RESOURCE_EXHAUSTED, 429),
        (kv.LayoutMismatchError("dtype"), Code.INVALID_ARGUMENT, 400),
        (kv.LeaseExpiredError("gone"), Code.NOT_FOUND, 404),
        (kv.PeerUnavailableError("down"), Code.UNAVAILABLE, 503),
        (kv.TransferTimeoutError("slow"), Code.DEADLINE_EXCEEDED, 504),
        (kv.NoBlocksError("full"), Code.RESOURCE_EXHAUSTED, 429),
        (UnknownModelError("model: 'x'"), Code.NOT_FOUND, 404),
        (AuthError("invalid API key"), Code.UNAUTHENTICATED, 401),
        (PermissionDeniedError("needs an admin key"), Code.PERMISSION_DENIED, 403),
        (QuotaExceeded("acme", 10, 1.5), Code.RESOURCE_EXHAUSTED, 429),
        (NoWorkerError("no decode worker"), Code.UNAVAILABLE, 503),
        (IncompatibleWorkerError("layout"), Code.FAILED_PRECONDITION, 400),
        (StatusError(Code.DEADLINE_EXCEEDED, "no token for 5s"), Code.DEADLINE_EXCEEDED, 504),
        (RuntimeError("boom"), Code.INTERNAL, 500),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_every_error_has_one_status_and_its_http_code(
    exc: BaseException, code: grpc.StatusCode, http: int
) -> None:
    assert code_for(exc) == code
    assert status_for(exc)[0] == code
    assert http_for_status(code)[0] == http
    if hasattr(type(exc), "code") and not isinstance(exc, kv.TransferError):
        assert exc.code == code  # type: ignore[attr-defined]  # the table, read back


def test_messages_say_what_went_wrong() -> None:
    assert (
        status_for(OutOfBlocksError("need 3 KV blocks"))[1] == "no KV blocks free: need 3 KV blocks"
    )
    assert status_for(RuntimeError("boom"))[1] == "RuntimeError: boom"
    assert status_for(kv.TransferError("read failed"))[1] == "read failed"
    assert status_for(AuthError("invalid API key"))[1] == "invalid API key"
    assert AuthError("x").denied is False and PermissionDeniedError("x").denied is True


def test_the_services_raise_the_classes_of_the_table() -> None:
    assert PlacementNoWorkerError is NoWorkerError
    assert RegistryIncompatible is IncompatibleWorkerError


def test_transfer_errors_code_attributes_agree_with_the_table() -> None:
    """kvtransfer's errors still carry a `code` of their own; until they drop it, it
    must say what the table says."""
    for cls in (c for c in STATUS if issubclass(c, kv.TransferError)):
        own = getattr(cls, "code", None)
        assert own is None or own == STATUS[cls], cls.__name__
