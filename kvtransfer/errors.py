"""Typed KV-transfer errors, each carrying the gRPC status a service should return."""

from __future__ import annotations

import grpc


class TransferError(Exception):
    """Base class; `code` is the gRPC status the failure maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidHandleError(TransferError):
    """A KvHandle is corrupt, of another protocol version, or does not fit the request."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class LayoutMismatchError(InvalidHandleError):
    """The peers' KV layouts differ (model, dtype, block size, heads, ...)."""


class PeerUnavailableError(TransferError):
    """The exporter cannot be reached or died during the transfer."""

    code = grpc.StatusCode.UNAVAILABLE


class TransferTimeoutError(TransferError):
    """The transfer did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class LeaseExpiredError(TransferError):
    """The exporter no longer holds the blocks (lease expired or already released)."""

    code = grpc.StatusCode.NOT_FOUND


class NoBlocksError(TransferError):
    """The importing engine has no room for the request's blocks right now."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class KvCorruptionError(TransferError):
    """Blocks that arrived differ from the exporter's checksums, after a re-read too."""

    code = grpc.StatusCode.DATA_LOSS
