"""One flow-control request's record: who sent it, in which class, and how it ended
(served, refused, or failed).

Lifecycle: the flow runner makes a `FlowRecord` when it sends a request (times are
seconds from the phase's start on a monotonic clock), fills in the first token, the token
counts and the end as the stream runs, and on a gRPC error its code, message and
`refusal` (`loadtest.flow.refusal`). The metrics then read the records; nothing changes
them after the phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.priority import Priority
from loadtest.flow.refusal import Refusal
from loadtest.harness.metrics import percentile

OK = "OK"


@dataclass
class FlowRecord:
    request_id: str
    tenant: str
    priority: Priority
    gateway: int
    sent_s: float
    code: str = OK  # gRPC status name
    details: str = ""
    refusal: Refusal | None = None
    first_token_s: float | None = None
    finished_s: float = 0.0
    prompt_tokens: int = 0  # from the final usage (0 if the stream did not finish)
    output_tokens: int = 0  # from the final usage
    streamed_tokens: int = 0  # tokens received, however the stream ended
    # Seconds between successive tokens after the first: a message of n tokens after a
    # gap of g adds n gaps of g / n.
    token_gaps_s: list[float] = field(default_factory=list)
    last_token_s: float | None = None

    def took(self, now_s: float, tokens: int) -> None:
        """A message of `tokens` tokens arrived at `now_s` (with n > 1 the forks'
        messages interleave, so the gaps run across forks: the flow benchmarks send
        n = 1)."""
        if tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now_s
        elif self.last_token_s is not None:
            self.token_gaps_s.extend([(now_s - self.last_token_s) / tokens] * tokens)
        self.last_token_s = now_s
        self.streamed_tokens += tokens

    @property
    def itl_p90_s(self) -> float | None:
        """The 90th percentile of its own token gaps (None with fewer than two tokens)."""
        return percentile(self.token_gaps_s, 90) if self.token_gaps_s else None

    @property
    def completed(self) -> bool:
        return self.code == OK and self.first_token_s is not None

    @property
    def refused(self) -> bool:
        return self.refusal is not None

    @property
    def failed(self) -> bool:
        """Ended in an error that was not a refusal (a deadline, a lost worker)."""
        return self.code != OK and self.refusal is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def refusal_latency_s(self) -> float | None:
        """Send to refusal: how long the client waited to be told no."""
        return self.finished_s - self.sent_s if self.refused else None

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks the request held at its end: ceil((prompt + generated) / block)."""
        return math.ceil((self.prompt_tokens + self.output_tokens) / block_size)

    def kv_block_seconds(self, block_size: int) -> float:
        """The KV cache it was served, in block-seconds: its blocks at the end times its
        decode residency (first token to end). Prefill residency and the blocks it grew
        into are left out on purpose: the decode pool is the binding resource here,
        and every request's prefill is the same size, so they would add a constant."""
        if not self.completed or self.first_token_s is None:
            return 0.0
        return self.kv_blocks(block_size) * max(0.0, self.finished_s - self.first_token_s)
