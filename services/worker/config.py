"""The worker process's own settings (its engine and KV transfer have their own configs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.role import Role
from services.router.keyspace import pool_namespace


@dataclass(frozen=True)
class WorkerConfig:
    role: Role = field(default=Role.MIXED, metadata={"help": "prefill, decode or mixed"})
    host: str = field(default="127.0.0.1", metadata={"help": "address the worker binds"})
    port: int = field(default=0, metadata={"help": "worker gRPC port (0 = any free port)"})
    worker_id: str = field(default="", metadata={"help": "stable worker id (default: role-pid)"})
    drain_timeout_s: float = field(
        default=10.0, metadata={"help": "on SIGTERM, seconds to let running streams finish"}
    )
    redis_url: str = field(
        default="",
        metadata={"help": "register with the router's Redis at this URL (empty: no registry)"},
    )
    namespace: str = field(default="pdserve", metadata={"help": "the cluster's Redis key prefix"})
    served_model_name: str = field(
        default="",
        metadata={
            "help": "the name clients send as `model` for this worker's model, when the "
            "cluster serves several (the gateway's --served-model-name or --extra-models); "
            "the worker then registers in the pool namespace <namespace>/<name> (empty: the "
            "cluster's one unnamed model, in <namespace>)"
        },
    )
    model_version: str = field(
        default="",
        metadata={"help": "a version of the served model (pool <namespace>/<name>@<version>)"},
    )
    heartbeat_ttl_s: float = field(
        default=10.0, metadata={"help": "registration lease; renewed every third of it"}
    )
    signal_interval_s: float = field(
        default=0.25,
        metadata={
            "help": "publish the worker's load signal (queued prompt tokens, KV use, speeds) "
            "to Redis this often, in seconds, for the gateway's admission (with --redis-url)"
        },
    )
    role_window_s: float = field(
        default=30.0,
        metadata={
            "help": "change the worker's home role (prefill <-> decode) at run time when the "
            "traffic mix has stayed shifted for this many seconds; at most one worker of the "
            "cluster changes per window (0 = the role given is kept for life; needs "
            "--redis-url)"
        },
    )
    role_long_prompt_tokens: int = field(
        default=512,
        metadata={
            "help": "for the role planner, a prompt of at least this many uncomputed tokens "
            "is long (match the gateway's --local-prefill-max-tokens)"
        },
    )
    cpu_cores: str = field(
        default="",
        metadata={"help": "pin every thread to these CPU core ids, comma-separated (empty: no)"},
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        pool_namespace(self.namespace, self.served_model_name, self.model_version)  # checks
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if not self.signal_interval_s > 0:
            raise ValueError(f"signal_interval_s must be > 0, got {self.signal_interval_s}")
        if self.role_window_s < 0 or self.role_long_prompt_tokens < 1:
            raise ValueError(
                f"role_window_s must be >= 0 and role_long_prompt_tokens >= 1, got "
                f"{self.role_window_s} and {self.role_long_prompt_tokens}"
            )
        if self.cpu_cores and not all(c.strip().isdigit() for c in self.cpu_cores.split(",")):
            raise ValueError(f"cpu_cores must be comma-separated core ids, got {self.cpu_cores!r}")

    @property
    def pool_namespace(self) -> str:
        """Where this worker registers: its served model's (and version's) namespace."""
        return pool_namespace(self.namespace, self.served_model_name, self.model_version)

    @property
    def cpu_core_ids(self) -> set[int]:
        return {int(c) for c in self.cpu_cores.split(",")} if self.cpu_cores else set()
