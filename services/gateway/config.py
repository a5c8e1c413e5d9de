"""The gateway's settings: where it listens, which workers it uses, limits, deadlines and
guardrails (the most one request may ask for, take, or leave unread)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.priority import Priority
from services.common.model_config import check_model_name, extra_model_dirs


@dataclass(frozen=True)
class GatewayConfig:
    gateway_host: str = field(default="127.0.0.1", metadata={"help": "address the gateway binds"})
    gateway_port: int = field(default=8470, metadata={"help": "gateway gRPC port (0 = any)"})
    http_host: str = field(
        default="", metadata={"help": "address the OpenAI HTTP API binds (empty: gateway_host)"}
    )
    http_port: int = field(
        default=8471,
        metadata={"help": "OpenAI-compatible HTTP port (0 = any, -1 = no HTTP API)"},
    )
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
    served_model_name: str = field(
        default="",
        metadata={
            "help": "the name clients send as `model` for --model (empty: its path, or the "
            "default model's name); when set, its workers register with the same "
            "--served-model-name, in the pool namespace <namespace>/<name>"
        },
    )
    extra_models: str = field(
        default="",
        metadata={
            "help": "more models this gateway serves, comma-separated NAME=MODEL_DIR (with "
            "placement redis): requests naming NAME get its tokenizer and limits and go to "
            "the workers started with --served-model-name NAME"
        },
    )
    lora_dir: str = field(
        default="",
        metadata={
            "help": "the LoRA adapters of --model (the directory its workers were started "
            "with as --lora-dir): listed in /v1/models, asked for as model 'ADAPTER' or "
            "'MODEL:ADAPTER'; empty: none"
        },
    )
    rollout_refresh_s: float = field(
        default=1.0,
        metadata={"help": "how often the gateway re-reads its named models' rollouts in Redis"},
    )
    rollout_window_s: float = field(
        default=60.0,
        metadata={"help": "a canary is judged on the requests of the last this many seconds"},
    )
    rollout_min_requests: int = field(
        default=20, metadata={"help": "canary requests in the window before it is judged"}
    )
    rollout_error_margin: float = field(
        default=0.05,
        metadata={
            "help": "roll a canary back when its error rate passes the stable version's by "
            "more than this (0.05: five points)"
        },
    )
    rollout_latency_margin: float = field(
        default=0.5,
        metadata={
            "help": "roll a canary back when its TTFT or ITL p90 passes the stable "
            "version's by more than this share (0.5: 50% slower)"
        },
    )
    prefill_retries: int = field(
        default=1, metadata={"help": "prefill retries on another worker before the first token"}
    )
    local_prefill_max_tokens: int = field(
        default=512,
        metadata={
            "help": "conditional disaggregation: a request whose prompt tokens not in its "
            "decode worker's prefix cache are at most this is prefilled there, skipping the "
            "prefill hop (0 = every request takes the hop)"
        },
    )
    local_prefill_busy_s: float = field(
        default=1.0,
        metadata={
            "help": "when the chosen prefill worker's queue would take longer than this and "
            "the decode worker's less, prompts of up to 4x local_prefill_max_tokens uncached "
            "tokens are prefilled locally too (0 = off)"
        },
    )
    elastic_roles: bool = field(
        default=True,
        metadata={
            "help": "a prefill worker with an empty queue also serves short requests whole "
            "(prefill and decode, no hop) while it carries fewer streams than the decode "
            "worker: on chat traffic both workers decode (false: prefill workers only prefill)"
        },
    )
    max_migrations: int = field(
        default=1,
        metadata={
            "help": "times one stream may move to another decode worker after tokens went "
            "out and its worker died or missed token_timeout_s (0 = never: the stream ends "
            "with the worker's status, and KV lost at the hand-off is not prefilled again)"
        },
    )

    api_keys_file: str = field(
        default="",
        metadata={
            "help": "file of '<tenant> <key> [admin] [tpm=N]' lines; callers must send a key "
            "(empty: no auth, one anonymous tenant)"
        },
    )
    tokens_per_minute: int = field(
        default=0,
        metadata={"help": "per-tenant token quota per minute, kept in Redis (0 = unlimited)"},
    )
    usage_ledger: bool = field(
        default=True,
        metadata={
            "help": "write each served request's token usage to the Redis Stream "
            "<namespace>:usage (needs a Redis; read it with `pdserve usage`)"
        },
    )
    usage_retention_s: float = field(
        default=86400.0,
        metadata={
            "help": "usage ledger entries older than this are trimmed: export them first "
            "(about 170 bytes of Redis memory per request kept)"
        },
    )
    usage_max_entries: int = field(
        default=2_000_000,
        metadata={
            "help": "and the oldest beyond this many are trimmed too, whatever their age "
            "(2,000,000 is about 340 MB of Redis memory)"
        },
    )
    tenant_label_limit: int = field(
        default=20,
        metadata={
            "help": "tenants by traffic that get their own `tenant` label on the per-tenant "
            "metrics; the rest count as 'other' (bounds the series)"
        },
    )

    # Guardrails: no one request may take more than an operator allows.
    max_tokens_limit: int = field(
        default=4096,
        metadata={"help": "highest max_tokens a request may ask for (INVALID_ARGUMENT above)"},
    )
    request_deadline_s: float = field(
        default=600.0,
        metadata={"help": "total time one request may take, admission to last token"},
    )
    slow_client_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "a client that takes no message for this long while its stream buffer "
            "holds some is disconnected and its request aborted"
        },
    )
    stream_buffer_messages: int = field(
        default=64,
        metadata={"help": "messages buffered per stream for a client that reads slowly"},
    )

    # Admission: say no fast, in class order, instead of queueing past any SLO.
    admission_control: bool = field(
        default=True,
        metadata={
            "help": "admit a request only when the workers' live signals (Redis) say it can "
            "start within its class's TTFT budget; else it waits in the waiting room"
        },
    )
    ttft_budget_critical_s: float = field(
        default=10.0, metadata={"help": "critical: TTFT budget, and its longest wait to start"}
    )
    ttft_budget_standard_s: float = field(
        default=5.0, metadata={"help": "standard: TTFT budget, and its longest wait to start"}
    )
    ttft_budget_sheddable_s: float = field(
        default=2.0, metadata={"help": "sheddable: TTFT budget, and its longest wait to start"}
    )
    itl_budget_s: float = field(
        default=0.0,
        metadata={
            "help": "admit a stream only while the decode step it would join (its "
            "inter-token latency, predicted from the workers' measured step times by batch "
            "size) stays within this: critical up to all of it, standard 90%, sheddable "
            "80%, so the lowest class waits first (0 = off, the default: on a host whose "
            "steps pass it, it also holds short requests back; see docs/design.md)"
        },
    )
    waiting_room_size: int = field(
        default=256,
        metadata={"help": "requests that may wait for capacity on this gateway (0 = none)"},
    )
    fair_share_half_life_s: float = field(
        default=30.0,
        metadata={"help": "half-life of each tenant's attained service in the fair-share ledger"},
    )

    def budget_s(self, priority: Priority) -> float:
        """The class's TTFT budget: the most a request of it may wait to be admitted, and
        the TTFT admission lets it in for (a prompt whose prefill alone takes most of it
        may still wait a tenth of it, so an idle pool serves it: `Admission._fits`)."""
        return {
            Priority.CRITICAL: self.ttft_budget_critical_s,
            Priority.STANDARD: self.ttft_budget_standard_s,
            Priority.SHEDDABLE: self.ttft_budget_sheddable_s,
        }[priority]

    def __post_init__(self) -> None:
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [-1, 65535] (-1 = off), got {self.http_port}")
        if self.tokens_per_minute < 0:
            raise ValueError(f"tokens_per_minute must be >= 0, got {self.tokens_per_minute}")
        if self.api_keys_file and not Path(self.api_keys_file).is_file():
            raise ValueError(f"api_keys_file: no such file {self.api_keys_file!r}")
        if self.max_streams <= 0:
            raise ValueError(f"max_streams must be > 0, got {self.max_streams}")
        if min(self.prefill_timeout_s, self.first_token_timeout_s, self.token_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        for name in ("max_tokens_limit", "request_deadline_s", "slow_client_timeout_s",
                     "stream_buffer_messages", "ttft_budget_critical_s", "ttft_budget_standard_s",
                     "ttft_budget_sheddable_s", "fair_share_half_life_s",
                     "usage_retention_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.rollout_refresh_s <= 0 or self.rollout_window_s <= 0:
            raise ValueError("rollout_refresh_s and rollout_window_s must be > 0")
        if self.rollout_min_requests < 1:
            raise ValueError(f"rollout_min_requests must be >= 1, got {self.rollout_min_requests}")
        if self.rollout_error_margin < 0 or self.rollout_latency_margin < 0:
            raise ValueError("rollout_error_margin and rollout_latency_margin must be >= 0")
        if self.local_prefill_max_tokens < 0 or self.local_prefill_busy_s < 0:
            raise ValueError("local_prefill_max_tokens and local_prefill_busy_s must be >= 0")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.itl_budget_s < 0:
            raise ValueError(f"itl_budget_s must be >= 0 (0 = off), got {self.itl_budget_s}")
        if self.usage_max_entries < 1:
            raise ValueError(f"usage_max_entries must be >= 1, got {self.usage_max_entries}")
        if self.tenant_label_limit < 0:
            raise ValueError(f"tenant_label_limit must be >= 0, got {self.tenant_label_limit}")
        if self.waiting_room_size < 0:
            raise ValueError(f"waiting_room_size must be >= 0, got {self.waiting_room_size}")
        if self.placement not in ("static", "redis"):
            raise ValueError(f"placement must be static or redis, got {self.placement!r}")
        check_model_name(self.served_model_name, "served_model_name")
        extra = self.extra_model_dirs  # parses and checks the list
        if extra and self.placement != "redis":
            raise ValueError("extra_models needs placement redis: each model has its own pool")
        if self.served_model_name in extra:
            raise ValueError(f"extra_models: {self.served_model_name!r} names --model already")
        if self.placement == "static" and not self.decode_workers:
            raise ValueError("decode_workers: static placement needs at least one worker address")

    @property
    def extra_model_dirs(self) -> dict[str, str]:
        """`extra_models` as name -> model directory, in order."""
        return extra_model_dirs(self.extra_models)

    @property
    def http_bind_host(self) -> str:
        return self.http_host or self.gateway_host

    @property
    def prefill_list(self) -> list[str]:
        return [a.strip() for a in self.prefill_workers.split(",") if a.strip()]

    @property
    def decode_list(self) -> list[str]:
        return [a.strip() for a in self.decode_workers.split(",") if a.strip()]
