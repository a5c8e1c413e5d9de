"""Settings of a pdserve cluster on Ray: where the actors go and how they recover.

Built from `pdserve up --ray` flags (`PDSERVE_*` env vars) like every
other config; the pool sizes, ports and model come from `ClusterConfig`, as for a local
`pdserve up`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def parse_resources(text: str, field_name: str = "resources") -> dict[str, float]:
    """Parse `name=amount,name2=amount`; a bad item raises ValueError naming `field_name`."""
    resources: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or value <= 0:
            raise ValueError(f"{field_name}: expected name=amount (> 0), got {item!r}")
        resources[name.strip()] = value
    return resources


@dataclass(frozen=True)
class RayConfig:
    ray_namespace: str = field(
        default="pdserve",
        metadata={"help": "Ray namespace of the cluster's named actors (and its Redis key prefix)"},
    )
    prefill_gpus: float = field(default=0.0, metadata={"help": "GPUs per prefill worker actor"})
    decode_gpus: float = field(
        default=0.0, metadata={"help": "GPUs per decode (or mixed) worker actor"}
    )
    worker_cpus: float = field(default=1.0, metadata={"help": "CPUs per worker actor"})
    service_cpus: float = field(default=0.5, metadata={"help": "CPUs per gateway and router actor"})
    prefill_resources: str = field(
        default="",
        metadata={"help": "custom Ray resources per prefill actor: name=amount,name2=amount"},
    )
    decode_resources: str = field(
        default="",
        metadata={"help": "custom Ray resources per decode (or mixed) actor: name=amount,..."},
    )
    num_routers: int = field(
        default=1, metadata={"help": "Router service actors (the gateway embeds its own router)"}
    )
    max_restarts: int = field(
        default=-1,
        metadata={"help": "restarts Ray gives a failed service actor (-1 = unlimited)"},
    )
    redis_url: str = field(
        default="",
        metadata={"help": "the router's Redis (empty: embedded in the controller; one node only)"},
    )

    def __post_init__(self) -> None:
        if not self.ray_namespace:
            raise ValueError("ray_namespace must be non-empty")
        for name in ("prefill_gpus", "decode_gpus", "worker_cpus", "service_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_routers < 0:
            raise ValueError(f"num_routers must be >= 0, got {self.num_routers}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1 (unlimited), got {self.max_restarts}")
        parse_resources(self.prefill_resources, "prefill_resources")
        parse_resources(self.decode_resources, "decode_resources")
