"""Typed errors raised by the engine.

Every error names what was wrong so that the services can map it to a gRPC status
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, DEADLINE_EXCEEDED) with a message a
user can act on.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request field is outside its allowed range.

    `field` is the request field's name as the API spells it, `limit` the bound it
    broke, stated so a user can fix the request (for example "must be > 0").
    """

    def __init__(self, field: str, limit: str, value: object | None = None) -> None:
        self.field = field
        self.limit = limit
        self.value = value
        shown = "" if value is None else f" (got {value!r})"
        super().__init__(f"{field}: {limit}{shown}")


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model directory or the default model's GGUF could not be found or is incomplete."""


class OutOfBlocksError(EngineError, MemoryError):
    """The KV block pool cannot satisfy an allocation that had to succeed now."""


class UnknownRequestError(EngineError, KeyError):
    """An operation named a request id that the engine does not hold."""


class DeadlineExceededError(EngineError, TimeoutError):
    """A request's deadline passed before it finished and the engine ended it (raised by
    `RequestOutput.raise_for_deadline` for an output that ended with DEADLINE)."""


class UnknownAdapterError(EngineError, LookupError):
    """A request named a LoRA adapter this engine does not have (or has no adapter
    directory at all)."""


class AdapterFormatError(EngineError, ValueError):
    """A LoRA adapter cannot be served: its files are missing, unreadable, of another
    base model or use a feature the engine does not run (the message names which)."""


class AdapterMismatchError(AdapterFormatError):
    """Two parties disagree on an adapter's identity (its digest): a KV hand-off between
    them, or a request routed for another copy of the adapter, is refused."""


class AdaptersBusyError(EngineError):
    """Every resident adapter slot (`max_loras`) is held by live requests of other
    adapters, so a new adapter cannot be loaded now; retry shortly or elsewhere."""
