"""Why a request's output ended: the engine decides it, every layer above reports it."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    """Why a request's output ended: a stop (EOS, stop token or string), the length limit
    (max_tokens or the context length), an abort (cancelled, or the engine failed), or
    its deadline (it passed while the request was preempted, so it was not recomputed)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    DEADLINE = "deadline"

    @property
    def completed(self) -> bool:
        """The output ran to its natural end (a stop or the length limit)."""
        return self in (FinishReason.STOP, FinishReason.LENGTH)
