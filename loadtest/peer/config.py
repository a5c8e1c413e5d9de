"""Settings of the peer benchmark (`loadtest.peer.bench`): the workload, the points, the
rounds, and how llama-server runs.

The defaults are the issue's comparison: chat-shaped prompts of about 256 tokens and
128 output tokens, at 1 stream (8 requests a point) and 16 concurrent streams (32 a
point), 3 paired rounds; llama-server with 2 threads and 16 slots with continuous
batching (the host's cores; a slot per stream) and a context of 16 x 512 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.precision import DType
from loadtest.harness.settings import parse_ints

#: The issue's targets: pdserve's output tokens/s over llama-server's at each point.
TARGET_RATIO_16 = 1.5
TARGET_RATIO_1 = 1.0


@dataclass(frozen=True)
class PeerBenchConfig:
    out_dir: Path = field(
        default=Path("bench-results/peer"), metadata={"help": "where peer.json and peer.md go"}
    )
    rounds: int = field(
        default=3,
        metadata={"help": "paired rounds (each server runs every point once a round; who "
                  "goes first alternates); the report takes the medians of rounds"},
    )  # fmt: skip
    streams: str = field(
        default="1,16", metadata={"help": "concurrent streams of each point, comma-separated"}
    )
    requests_per_stream: int = field(
        default=2,
        metadata={"help": "requests a point sends per stream, at least 8 a point "
                  "(1 stream: 8; 16 streams: 32)"},
    )  # fmt: skip
    min_requests: int = field(default=8, metadata={"help": "fewest requests of one point"})
    prompt_tokens: int = field(
        default=256, metadata={"help": "prompt length in the served model's tokens"}
    )
    output_tokens: int = field(
        default=128, metadata={"help": "tokens every request generates (ignore_eos)"}
    )
    warmup_requests: int = field(
        default=4, metadata={"help": "unmeasured requests to each server before round 1"}
    )
    request_timeout_s: float = field(default=300.0, metadata={"help": "one stream's deadline"})
    grpc_breakdown: bool = field(
        default=True,
        metadata={"help": "also run pdserve's 1-stream point over gRPC each round, to split "
                  "the HTTP front door's share of the inter-token gap from the rest"},
    )  # fmt: skip
    llama_server: Path | None = field(
        default=None,
        metadata={"help": "llama-server binary (default: the one loadtest.peer.build made)"},
    )
    gguf: Path | None = field(
        default=None, metadata={"help": "model GGUF (default: loadtest.peer.build's bf16 one)"}
    )
    llama_threads: int = field(default=2, metadata={"help": "llama-server threads (-t, -tb)"})
    llama_slots: int = field(default=16, metadata={"help": "llama-server parallel slots (-np)"})
    llama_ctx_per_slot: int = field(
        default=512, metadata={"help": "context tokens per slot (-c is slots x this)"}
    )
    llama_extra_args: str = field(
        default="", metadata={"help": "more llama-server flags, shell-quoted"}
    )
    pdserve_dtype: DType | None = field(
        default=None,
        metadata={"help": "pdserve workers' dtype (default: theirs, auto: bf16 where the "
                  "CPU has it natively, else float32; bfloat16 holds them to "
                  "llama-server's bf16 weights on any host)"},
    )  # fmt: skip
    pdserve_gateway_args: str = field(
        default="",
        metadata={"help": "more flags for pdserve's gateway, shell-quoted (default: none, "
                  "its defaults; '--ttft-budget-standard-s 60' queues a burst of 16 "
                  "prompts where admission control would refuse some)"},
    )  # fmt: skip
    startup_timeout_s: float = field(
        default=300.0, metadata={"help": "seconds to wait for either server to be ready"}
    )
    progress: bool = field(default=True, metadata={"help": "progress bars"})

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if min(self.requests_per_stream, self.min_requests) < 1:
            raise ValueError("requests_per_stream and min_requests must be >= 1")
        if self.prompt_tokens < 32 or self.output_tokens < 2:
            raise ValueError("prompt_tokens must be >= 32 and output_tokens >= 2")
        if self.llama_threads < 1 or self.llama_slots < 1:
            raise ValueError("llama_threads and llama_slots must be >= 1")
        if self.llama_ctx_per_slot < self.prompt_tokens + self.output_tokens + 16:
            raise ValueError(
                f"llama_ctx_per_slot {self.llama_ctx_per_slot} cannot hold a request "
                f"({self.prompt_tokens} + {self.output_tokens} tokens and a margin)"
            )
        if max(self.stream_list) > self.llama_slots:
            raise ValueError(f"streams above llama_slots ({self.llama_slots}) would queue")

    @property
    def stream_list(self) -> tuple[int, ...]:
        return parse_ints(self.streams, "streams")

    def requests_at(self, streams: int) -> int:
        """Requests of the point at `streams` concurrent streams."""
        return max(self.min_requests, streams * self.requests_per_stream)
