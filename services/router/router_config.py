"""The router's settings: one frozen dataclass, built from `--flags` / `PDSERVE_*` env vars.

Lifecycle: a command adds these flags with `services.common.config.add_config_args`, builds
a `RouterConfig` with `config_from_args` (which validates it), and hands it to
`RedisPlacement.from_config` (or `Router`). Nothing here reads the environment itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Most leading blocks a placement looks up: each costs a set lookup per candidate.
MAX_MATCH_BLOCKS = 256

POLICIES = ("bounded", "bounded_ring", "consistent", "round_robin", "least_loaded", "random")


@dataclass(frozen=True)
class RouterConfig:
    redis_url: str = field(
        default="",
        metadata={
            "help": "Redis URL (redis://host:port/db or unix:///path); empty: the router "
            "service starts an embedded one, the gateway's redis placement refuses to start"
        },
    )
    namespace: str = field(
        default="pdserve", metadata={"help": "prefix of every Redis key this cluster uses"}
    )
    policy: str = field(default="bounded", metadata={"help": f"placement policy: {POLICIES}"})
    eps: float = field(
        default=0.25, metadata={"help": "bounded-load slack: cap is ceil((1+eps)*avg load)"}
    )
    cache_share: float = field(
        default=0.75,
        metadata={
            "help": "share of a worker's KV blocks the router's prefix-cache model assumes "
            "(policy bounded; the rest holds running requests)"
        },
    )
    prefix_blocks: int = field(
        default=4, metadata={"help": "full KV blocks of the prompt hashed into the routing key"}
    )
    match_blocks: int = field(
        default=32,
        metadata={
            "help": "leading KV blocks of the prompt looked up in the caches the workers "
            "report (policy bounded; 0: use the router's own cache model only)"
        },
    )
    block_size: int = field(
        default=16, metadata={"help": "tokens per KV block; must match the engines' block size"}
    )
    virtual_nodes: int = field(default=64, metadata={"help": "ring positions per worker"})
    load_ttl_s: float = field(
        default=60.0, metadata={"help": "seconds a load lease lives unless released"}
    )
    heartbeat_ttl_s: float = field(
        default=10.0, metadata={"help": "seconds a worker stays registered without a heartbeat"}
    )
    model_fingerprint: str = field(
        default="",
        metadata={"help": "model the cluster serves (empty = whatever the first worker has)"},
    )
    layout_fingerprint: str = field(
        default="",
        metadata={"help": "KV layout workers must have (empty = the first worker's)"},
    )
    slow_start_s: float = field(
        default=30.0,
        metadata={
            "help": "a worker that joins (new or restarted) a pool with warmer workers takes "
            "a share of the bounded-load bound ramping from 10% to all over this (0 = off)"
        },
    )
    down_s: float = field(
        default=5.0,
        metadata={
            "help": "seconds every router skips a worker after a call to it failed "
            "UNAVAILABLE (the shared breaker; its heartbeat lease would take "
            "heartbeat_ttl_s)"
        },
    )
    membership_refresh_s: float = field(
        default=1.0, metadata={"help": "seconds between re-reads of the worker registry"}
    )
    redis_timeout_s: float = field(
        default=0.5, metadata={"help": "Redis connect/read timeout before failing open"}
    )
    redis_retry_s: float = field(
        default=1.0,
        metadata={"help": "after a Redis error, seconds to route locally before retrying"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the random policy (for benchmarks)"})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0 (the bound needs slack), got {self.eps}")
        if not 0 < self.cache_share <= 1:
            raise ValueError(f"cache_share must be in (0, 1], got {self.cache_share}")
        if self.prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be >= 1, got {self.prefix_blocks}")
        if not 0 <= self.match_blocks <= MAX_MATCH_BLOCKS:
            raise ValueError(
                f"match_blocks must be in [0, {MAX_MATCH_BLOCKS}], got {self.match_blocks}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {self.virtual_nodes}")
        for name in ("load_ttl_s", "heartbeat_ttl_s", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("membership_refresh_s", "redis_retry_s", "slow_start_s", "down_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.namespace:
            raise ValueError("namespace must be non-empty")
