"""Mapping pdserve's typed errors onto gRPC status codes, with messages users can act on."""

from __future__ import annotations

import grpc

from engine.errors import InvalidRequestError, ModelNotFoundError, OutOfBlocksError
from kvtransfer.errors import TransferError


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TransferError):
        return exc.code, str(exc)
    if isinstance(exc, OutOfBlocksError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"no KV blocks free: {exc}"
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_for(exc)
    await context.abort(code, message)
