"""One request the load tester will send: what to ask, how much to generate, and when.

Lifecycle: a workload (`traffic.make_requests`) or a trace (`trace.trace_requests`)
builds the list of `BenchRequest`s up front, so the run itself only sends; the runner
turns each into a gateway `GenerateRequest` with `to_proto` at send time.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.v1 import gateway_pb2
from services.gateway.client import RequestOptions, build_request


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    kind: str  # workload class: chat, long, synthetic, trace (metrics are split by it)
    max_tokens: int
    prompt: str | None = None  # raw text, or
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), chat-templated
    tenant: str = ""  # bookkeeping only: the gateway API has no tenant field yet
    at_s: float | None = None  # arrival offset from the run start (trace replay only)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"{self.request_id}: exactly one of prompt and messages")
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens must be >= 1")
        if self.at_s is not None and self.at_s < 0:
            raise ValueError(f"{self.request_id}: at_s must be >= 0")

    def to_proto(self, *, ignore_eos: bool, run_tag: str) -> gateway_pb2.GenerateRequest:
        """Greedy (temperature 0) so the same request generates the same tokens on any
        deployment; with `ignore_eos` every request generates exactly `max_tokens`."""
        return build_request(
            self.prompt,
            RequestOptions(
                max_tokens=self.max_tokens,
                temperature=0.0,
                ignore_eos=ignore_eos,
                request_id=f"{run_tag}-{self.request_id}",
            ),
            messages=self.messages,
        )
