"""The gateway's settings: where it listens, which workers it uses, limits and deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GatewayConfig:
    gateway_host: str = field(default="127.0.0.1", metadata={"help": "address the gateway binds"})
    gateway_port: int = field(default=8470, metadata={"help": "gateway gRPC port (0 = any)"})
    prefill_workers: str = field(
        default="",
        metadata={
            "help": "comma-separated prefill workers, host:port or id=host:port (empty: mixed)"
        },
    )
    decode_workers: str = field(
        default="",
        metadata={"help": "comma-separated decode (or mixed) workers, host:port or id=host:port"},
    )
    max_streams: int = field(
        default=64, metadata={"help": "concurrent streams before RESOURCE_EXHAUSTED"}
    )
    prefill_timeout_s: float = field(
        default=120.0, metadata={"help": "deadline of one prefill call"}
    )
    first_token_timeout_s: float = field(
        default=60.0,
        metadata={"help": "deadline from decode start to its first token (incl. KV transfer)"},
    )
    token_timeout_s: float = field(
        default=30.0, metadata={"help": "longest wait between two streamed tokens"}
    )
    placement: str = field(
        default="static",
        metadata={
            "help": "static (the worker lists) or redis (the router's registry, --redis-url)"
        },
    )
    prefill_retries: int = field(
        default=1, metadata={"help": "prefill retries on another worker before the first token"}
    )

    def __post_init__(self) -> None:
        if self.max_streams <= 0:
            raise ValueError(f"max_streams must be > 0, got {self.max_streams}")
        if min(self.prefill_timeout_s, self.first_token_timeout_s, self.token_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.placement not in ("static", "redis"):
            raise ValueError(f"placement must be static or redis, got {self.placement!r}")
        if self.placement == "static" and not self.decode_workers:
            raise ValueError("decode_workers: static placement needs at least one worker address")

    @property
    def prefill_list(self) -> list[str]:
        return [a.strip() for a in self.prefill_workers.split(",") if a.strip()]

    @property
    def decode_list(self) -> list[str]:
        return [a.strip() for a in self.decode_workers.split(",") if a.strip()]
