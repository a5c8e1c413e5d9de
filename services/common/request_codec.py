"""The wire codec of the request contract: `RequestSpec` <-> the worker protos.

Lifecycle of a request's fields across the hop to a worker: the gateway encodes its
`RequestSpec` once per worker call (`prefill_request`, `decode_request`); the worker's
handler decodes the message once (`spec_of`) and hands the spec to its engine or
importer. Nothing else on either side reads or writes these fields.

What travels where:
- the prompt, sampling (`services.common.sampling`), request id, cache salt and cache
  weight as fields (an unset weight reads as 1);
- the priority class in the `Priority` enum, whose values are the engine's plus one (0
  is "unspecified"); a worker runs a request at the class the gateway sent, STANDARD if
  none or one it does not know (a worker never refuses a request for its class); a
  client's class, on the gateway's own API, is read strictly (`priority_from_proto`);
- the LoRA adapter as name and digest (an unset field, or an empty name: the model);
- a migrated stream's tokens so far (`resume_token_ids`, Decode only);
- the deadline in no field: it is each worker call's gRPC deadline, which the worker
  turns back into one on its own monotonic clock (`spec_of(msg, time_remaining_s)`).
"""

from __future__ import annotations

import time
from typing import TypeAlias

from engine.adapter_ref import AdapterRef
from engine.errors import InvalidRequestError
from engine.priority import Priority
from engine.request_spec import RequestSpec
from pdserve.v1 import common_pb2, worker_pb2
from services.common import sampling

UNSPECIFIED = common_pb2.PRIORITY_UNSPECIFIED

WorkerRequest: TypeAlias = worker_pb2.PrefillRequest | worker_pb2.DecodeRequest


def prefill_request(spec: RequestSpec) -> worker_pb2.PrefillRequest:
    """The Prefill call for `spec` (whose deadline rides as the call's timeout)."""
    return worker_pb2.PrefillRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        sampling=sampling.to_proto(spec.sampling),
        cache_salt=spec.cache_salt,
        cache_weight=spec.cache_weight,
        priority=priority_to_proto(spec.priority),
        adapter=_adapter_message(spec.adapter),
    )


def decode_request(
    spec: RequestSpec, handle: common_pb2.KvHandle | None = None
) -> worker_pb2.DecodeRequest:
    """The Decode call for `spec`: importing `handle`'s KV, or (None) computing it."""
    msg = worker_pb2.DecodeRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        sampling=sampling.to_proto(spec.sampling),
        cache_salt=spec.cache_salt,
        cache_weight=spec.cache_weight,
        priority=priority_to_proto(spec.priority),
        resume_token_ids=spec.resume_token_ids,
        adapter=_adapter_message(spec.adapter),
    )
    if handle is not None:
        msg.kv_handle.CopyFrom(handle)
    return msg


def spec_of(msg: WorkerRequest, time_remaining_s: float | None = None) -> RequestSpec:
    """The request a worker call carries; its deadline `time_remaining_s` from now (the
    call's, None: none). Raises InvalidRequestError naming a bad sampling field."""
    resume = tuple(msg.resume_token_ids) if isinstance(msg, worker_pb2.DecodeRequest) else ()
    deadline = None if time_remaining_s is None else time.monotonic() + time_remaining_s
    return RequestSpec(
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=sampling.from_proto(msg.sampling),
        request_id=msg.request_id,
        cache_salt=msg.cache_salt,
        cache_weight=msg.cache_weight or 1.0,  # unset (0): an even share
        priority=_worker_priority(msg.priority),
        deadline=deadline,
        adapter=adapter_of(msg.adapter),
        resume_token_ids=resume,
    )


# -- priority classes ----------------------------------------------------------------
def priority_to_proto(priority: Priority) -> common_pb2.Priority.ValueType:
    return common_pb2.Priority.ValueType(int(priority) + 1)


def priority_from_proto(value: int, field: str = "priority") -> Priority | None:
    """The class a client's proto value names; None for UNSPECIFIED. A value no class
    has (proto3 enums are open: a newer or broken client can send any number) is
    INVALID_ARGUMENT naming `field` and the allowed names."""
    if value == UNSPECIFIED:
        return None
    try:
        return Priority(value - 1)
    except ValueError:
        allowed = ", ".join(p.label for p in Priority)
        raise InvalidRequestError(field, f"must be one of {allowed}", value) from None


def _worker_priority(value: int) -> Priority:
    try:
        sent = priority_from_proto(value)
    except InvalidRequestError:
        return Priority.STANDARD
    # Not `sent or STANDARD`: SHEDDABLE is 0, so falsy.
    return Priority.STANDARD if sent is None else sent


# -- LoRA adapters ---------------------------------------------------------------------
def adapter_of(message: common_pb2.Adapter) -> AdapterRef | None:
    """The adapter `message` names (None: the base model)."""
    return AdapterRef(message.name, message.digest) if message.name else None


def _adapter_message(adapter: AdapterRef | None) -> common_pb2.Adapter | None:
    if adapter is None:
        return None
    return common_pb2.Adapter(name=adapter.name, digest=adapter.digest)
