"""Mapping gRPC failures of the transfer control plane onto typed transfer errors."""

from __future__ import annotations

import grpc

from kvtransfer.errors import (
    InvalidHandleError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)

_BY_CODE: dict[grpc.StatusCode, type[TransferError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferTimeoutError,
    grpc.StatusCode.NOT_FOUND: LeaseExpiredError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidHandleError,
    grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatchError,
}


def transfer_error_from_rpc(exc: grpc.RpcError, what: str) -> TransferError:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    cls = _BY_CODE.get(code, PeerUnavailableError)
    return cls(f"{what} failed: {code.name}: {details}")
