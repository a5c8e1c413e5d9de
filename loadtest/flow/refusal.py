"""A refused request, as the load tester sees it: which status, why, and the retry hint.

Lifecycle: the flow runner catches a gRPC error and calls `refusal_of(code, details,
trailing metadata, got_token)` once; a `Refusal` goes into the request's record, and
the metrics count refusals by status and reason. Anything else that failed is an error,
not a refusal: a refusal is the gateway saying no before any worker did work, so it
comes before the first token, with one of the two codes the gateway refuses with.

Statuses are given as their HTTP equivalents, through the one status table the gateway
uses for both front doors (`services/common/status.py`, `openai_schema.http_for_status`):
RESOURCE_EXHAUSTED is 429 (a tenant's quota, the gateway's stream cap), UNAVAILABLE is
503 (overload: the waiting room is full, a higher class took the place, or the class's
TTFT budget ran out while waiting).

The reason is the call's trailing metadata `refusal-reason` (the gateway's
`RefusalReason` value), sent with every refusal beside its retry hint `retry-after-ms`.
A failure without one is an error, not a refusal (no worker registered, say).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.common.status import RefusalReason

#: gRPC status name -> the HTTP status the gateway's OpenAI API answers with.
REFUSAL_STATUS = {"RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}
REASON_KEY = "refusal-reason"
RETRY_KEY = "retry-after-ms"


@dataclass(frozen=True)
class Refusal:
    status: int  # 429 or 503
    reason: RefusalReason
    retry_after_s: float | None  # the gateway's hint; None if it sent none


def metadata_dict(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """gRPC metadata pairs as a dict of strings (binary values decoded leniently)."""
    out: dict[str, str] = {}
    for key, value in metadata or ():
        out[key] = value.decode(errors="replace") if isinstance(value, bytes) else value
    return out


def retry_after_s(metadata: Mapping[str, str]) -> float | None:
    try:
        return int(metadata[RETRY_KEY]) / 1000.0
    except (KeyError, ValueError):
        return None


def reason_of(metadata: Mapping[str, str]) -> RefusalReason | None:
    """The reason the gateway gave, or None if this was not a refusal."""
    try:
        return RefusalReason(metadata.get(REASON_KEY, ""))
    except ValueError:
        return None


def refusal_of(
    code: str, details: str, metadata: Mapping[str, str], got_token: bool
) -> Refusal | None:
    """The refusal a failed call was, or None for any other failure."""
    status = REFUSAL_STATUS.get(code)
    if got_token or status is None:
        return None
    reason = reason_of(metadata)
    if reason is None:
        return None
    return Refusal(status, reason, retry_after_s(metadata))
