"""A request the gateway has validated, as the rest of its life reads it.

Lifecycle: `GatewayService.prepare` makes one from a GenerateRequest (tokenized, its
sampling checked against the model, its total deadline started), and `stream` fills in
what the caller's key decides (tenant, class, fair-share weight) before it opens the
request's `RequestRecord`; from then on the record, the stream and its recovery only
read it. Each one gets its own `worker_request_id` for the workers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.lora import AdapterRef
from engine.priority import Priority
from engine.sampling_params import SamplingParams


@dataclass
class Prepared:
    """A validated request: what the record and the stream need to run it."""

    request_id: str  # the client's (or a generated one): in responses, logs and spans
    prompt: list[int]
    params: SamplingParams
    tenant: str
    deadline: float  # time.monotonic() by which the request must have ended
    priority: Priority = Priority.STANDARD  # its class, resolved against the caller's key
    weight: float = 1.0  # its tenant's fair-share weight
    # The id the workers see. A client-chosen id need not be unique (two clients, or one
    # retrying, may send the same), and a worker holding a live request under that id
    # refuses the second one and lets the first one stall; so each request gets its own.
    worker_request_id: str = ""
    model: str = ""  # the served model's name (`ModelCatalog`; "": the primary)
    adapter: AdapterRef | None = None  # the LoRA adapter it runs (None: the model itself)

    def __post_init__(self) -> None:
        if not self.worker_request_id:
            self.worker_request_id = f"{self.request_id}.{uuid.uuid4().hex[:8]}"
