"""What a local cluster is made of (`ClusterConfig`): how many workers of each role, the
gateways, the ports, the model, and the flags handed on to each child.

Lifecycle: `pdserve up` (or a test, a benchmark, the Ray launcher) builds one frozen
`ClusterConfig` from its flags and `PDSERVE_*` env vars (`services.common.config`);
`__post_init__` refuses bad values before any process starts. `LocalCluster` (or the
Ray controller) then reads it to launch the children: the fields named in
`GATEWAY_PASSTHROUGH`, `WORKER_PASSTHROUGH` and `LORA_PASSTHROUGH` go on unchanged as the
same-named flags of `pdserve gateway` / `pdserve worker`, and only when set, so an unset
one leaves each child its own default.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import DEFAULT_MODEL_CACHE, SpecMode
from engine.precision import DType, KvCacheDType, WeightQuant
from services.common.model_config import extra_model_dirs

# ClusterConfig options passed on as the same-named flags of `pdserve gateway` / `worker`.
GATEWAY_PASSTHROUGH = (
    "prefill_timeout_s", "first_token_timeout_s", "token_timeout_s", "heartbeat_ttl_s",
    "load_ttl_s", "api_keys_file", "tokens_per_minute", "local_prefill_max_tokens",
    "extra_models", "served_model_name", "lora_dir",
)  # fmt: skip
ZERO_ALLOWED = ("local_prefill_max_tokens",)  # 0 means something: the hop for every prompt
WORKER_PASSTHROUGH = (
    "heartbeat_ttl_s", "kv_lease_ttl_s", "dtype", "quantization", "kv_cache_dtype",
    "speculative_decoding", "served_model_name",
)  # fmt: skip
# The primary model's workers only: an extra model is another base, its adapters not these.
LORA_PASSTHROUGH = ("lora_dir", "max_loras")


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = field(
        default=1, metadata={"help": "prefill workers (0 = mixed workers only)"}
    )
    num_decode: int = field(
        default=1, metadata={"help": "decode workers (mixed workers when num_prefill is 0)"}
    )
    gateway_port: int = field(default=8470, metadata={"help": "gateway gRPC port (0 = any)"})
    http_port: int | None = field(
        default=None,
        metadata={
            "help": "gateway's OpenAI HTTP port (0 = any, -1 = off; "
            "default 8471, or any when gateway_port is 0)"
        },
    )
    worker_threads: int = field(default=1, metadata={"help": "torch threads per worker"})
    worker_kv_cache_bytes: int = field(
        default=256 << 20, metadata={"help": "KV pool bytes per worker"}
    )
    kv_backend: str = field(default="nixl", metadata={"help": "KV transfer backend: nixl or tcp"})
    # None leaves each worker its own default (its PDSERVE_DTYPE, else auto): a flag
    # passed always would override the env of every worker this cluster starts.
    dtype: DType | None = field(
        default=None,
        metadata={"help": "workers' compute dtype: auto (bf16 where native), float32, ..."},
    )
    quantization: WeightQuant | None = field(
        default=None, metadata={"help": "workers' weights: none or int8 (CPU)"}
    )
    kv_cache_dtype: KvCacheDType | None = field(
        default=None, metadata={"help": "workers' KV cache: auto, int8 or fp8_e4m3"}
    )
    speculative_decoding: SpecMode | None = field(
        default=None, metadata={"help": "workers' speculative decoding: off, auto or on"}
    )
    model: str | None = field(
        default=None, metadata={"help": "HF-layout model dir (default: SmolLM2-135M-Instruct)"}
    )
    model_cache_dir: Path = field(
        default=DEFAULT_MODEL_CACHE, metadata={"help": "where the default model is converted to"}
    )
    placement: str = field(
        default="redis",
        metadata={"help": "redis (embedded Redis + router registry) or static worker lists"},
    )
    redis_ha: bool = field(
        default=False,
        metadata={
            "help": "placement redis: a primary, a replica and three Sentinels (all "
            "embedded) instead of one Redis, so the cluster survives losing the primary"
        },
    )
    max_streams: int = field(default=64, metadata={"help": "gateway's concurrent stream cap"})
    pin_workers: bool = field(
        default=False,
        metadata={"help": "pin worker i (prefill first) to allowed CPU core i mod cores"},
    )
    startup_timeout_s: float = field(
        default=300.0, metadata={"help": "seconds to wait for every process to be ready"}
    )
    # Deadlines and lease lengths handed to the children; None keeps each service's own
    # default. Fault tests shorten them so that deadlines and expiries fire within seconds.
    prefill_timeout_s: float | None = field(
        default=None, metadata={"help": "gateway: deadline of one prefill call"}
    )
    first_token_timeout_s: float | None = field(
        default=None, metadata={"help": "gateway: deadline from decode start to its first token"}
    )
    token_timeout_s: float | None = field(
        default=None, metadata={"help": "gateway: longest wait between two streamed tokens"}
    )
    heartbeat_ttl_s: float | None = field(
        default=None, metadata={"help": "workers' registration lease (and the gateway's view)"}
    )
    load_ttl_s: float | None = field(
        default=None, metadata={"help": "gateway: seconds a router load lease lives unreleased"}
    )
    kv_lease_ttl_s: float | None = field(
        default=None, metadata={"help": "prefill workers: seconds exported KV stays pinned"}
    )
    api_keys_file: str | None = field(
        default=None, metadata={"help": "gateway: API keys file (tenants); unset = no auth"}
    )
    tokens_per_minute: int | None = field(
        default=None, metadata={"help": "gateway: per-tenant token quota per minute"}
    )
    local_prefill_max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "gateway: conditional disaggregation threshold (0 = every prompt takes the "
            "prefill hop; unset = the gateway's default)"
        },
    )
    gateways: int = field(
        default=1,
        metadata={"help": "gateway replicas sharing the workers and Redis (extras: any port)"},
    )
    served_model_name: str = field(
        default="",
        metadata={
            "help": "the name of --model for clients (`model`), given to the gateway and its "
            "workers alike (empty: unnamed, in the base pool)"
        },
    )
    extra_models: str = field(
        default="",
        metadata={
            "help": "more models to serve, comma-separated NAME=MODEL_DIR: one mixed worker "
            "each (placement redis), which clients reach with `model: NAME`"
        },
    )
    lora_dir: str = field(
        default="",
        metadata={
            "help": "LoRA adapters of --model (a directory of PEFT adapters), given to the "
            "gateway and its workers alike (not to --extra-models' workers)"
        },
    )
    max_loras: int | None = field(
        default=None, metadata={"help": "workers: LoRA adapters resident at once"}
    )
    # One shell-quoted string (a flag and an env var are one string): any gateway flag
    # without a ClusterConfig field of its own, e.g. the admission knobs a benchmark sets.
    gateway_args: str = field(
        default="",
        metadata={
            "help": "extra flags for every gateway, shell-quoted "
            "(--gateway-args='--max-tokens-limit 512')"
        },
    )
    # The same for every worker of the primary model (a benchmark's static deployment
    # pins each worker's home role with --role-window-s 0, say).
    worker_args: str = field(
        default="",
        metadata={
            "help": "extra flags for every worker, shell-quoted (--worker-args='--role-window-s 0')"
        },
    )

    def __post_init__(self) -> None:
        if self.http_port is not None and not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [-1, 65535] (-1 = off), got {self.http_port}")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("num_prefill must be >= 0 and num_decode >= 1")
        if self.placement not in ("redis", "static"):
            raise ValueError(f"placement must be redis or static, got {self.placement!r}")
        if self.gateways < 1:
            raise ValueError(f"gateways must be >= 1, got {self.gateways}")
        for name in ("gateway_args", "worker_args"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        extra_model_dirs(self.extra_models)  # parses and checks the list
        if self.redis_ha and self.placement != "redis":
            raise ValueError("redis_ha needs placement redis (static placement has no Redis)")
        if self.extra_models and self.placement != "redis":
            raise ValueError("extra_models needs placement redis: each model has its own pool")
        for name in GATEWAY_PASSTHROUGH + WORKER_PASSTHROUGH + LORA_PASSTHROUGH:
            value = getattr(self, name)
            if not isinstance(value, int | float):
                continue
            if name in ZERO_ALLOWED:
                if value < 0:
                    raise ValueError(f"{name} must be >= 0, got {value}")
            elif value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
