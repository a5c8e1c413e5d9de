"""A request the gateway has validated, as the rest of its life reads it.

Lifecycle: `GatewayService.prepare` makes one from a `ClientRequest` (tokenized, checked
against the model and the operator's limits, its class resolved against the caller's
key, its total deadline started) before it opens the request's `RequestRecord`; from
then on the record, the stream and its recovery only read it. Its `spec` is what every
worker call carries (through `services.common.request_codec`): the prompt's token ids,
the sampling, the id the workers know it by, the tenant (its cache salt), the class and
the LoRA adapter.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.adapter_ref import AdapterRef
from engine.priority import Priority
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from services.router.placement import RouteQuery


def worker_request_id(request_id: str) -> str:
    """The id the workers see for a client's request. A client-chosen id need not be
    unique (two clients, or one retrying, may send the same), and a worker holding a
    live request under that id refuses the second one and lets the first one stall; so
    each request gets its own."""
    return f"{request_id}.{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Prepared:
    """A validated request: what the record and the stream need to run it."""

    spec: RequestSpec  # what the workers run (its request_id: `worker_request_id`)
    request_id: str  # the client's (or a generated one): in responses, logs and spans
    deadline: float  # time.monotonic() by which the request must have ended
    weight: float = 1.0  # its tenant's fair-share weight
    model: str = ""  # the served model's name (`ModelCatalog`; "": the primary)

    @property
    def prompt(self) -> Sequence[int]:
        return self.spec.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.spec.sampling

    @property
    def tenant(self) -> str:
        return self.spec.cache_salt

    @property
    def priority(self) -> Priority:
        """Its class, resolved against the caller's key."""
        return self.spec.priority

    @property
    def adapter(self) -> AdapterRef | None:
        """The LoRA adapter it runs (None: the model itself)."""
        return self.spec.adapter

    @property
    def worker_request_id(self) -> str:
        return self.spec.request_id

    def later_spec(self, resume: Sequence[int] = ()) -> RequestSpec:
        """The spec of a worker call after the stream's first (a moved stream's re-export
        or its new decode worker): the prompt's log-probabilities went out already;
        `resume` holds the tokens streamed so far."""
        sampling = replace(self.spec.sampling, prompt_logprobs=None)
        return replace(self.spec, sampling=sampling, resume_token_ids=tuple(resume))

    def route_query(self) -> RouteQuery:
        """What placement needs of this request (the client's id names it in spans)."""
        return RouteQuery(self.request_id, self.prompt, self.tenant, adapter=self.adapter)
