"""Settings of a pdserve cluster on Ray: where the actors go and how they recover.

Built from `pdserve up --ray` flags (`PDSERVE_*` env vars) like every
other config; the pool sizes, ports and model come from `ClusterConfig`, as for a local
`pdserve up`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.ray.autoscaler import AutoscaleConfig


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
    autoscale: bool = field(
        default=False,
        metadata={
            "bare": True,
            "help": "size the prefill pool on TTFT p90 (--slo-ttft-s) and queued prompt "
            "tokens, the decode pool on ITL p90 (--slo-itl-s) and KV utilisation",
        },
    )
    autoscale_interval_s: float = field(
        default=5.0, metadata={"help": "autoscale: seconds between decisions"}
    )
    autoscale_max_prefill: int = field(
        default=4, metadata={"help": "autoscale: most prefill workers"}
    )
    autoscale_max_decode: int = field(
        default=4, metadata={"help": "autoscale: most decode (or mixed) workers"}
    )
    autoscale_queued_tokens: int = field(
        default=4096,
        metadata={"help": "autoscale: queued prompt tokens per prefill worker it holds under"},
    )
    autoscale_kv_utilization: float = field(
        default=0.85, metadata={"help": "autoscale: decode pool KV utilisation it holds under"}
    )
    autoscale_up_cooldown_s: float = field(
        default=30.0, metadata={"help": "autoscale: least time between a change and a growth"}
    )
    autoscale_down_window_s: float = field(
        default=60.0,
        metadata={"help": "autoscale: how long every signal must stay under half its target"},
    )
    autoscale_down_cooldown_s: float = field(
        default=120.0, metadata={"help": "autoscale: least time between a change and a shrink"}
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
        self.autoscale_config(1.0, 0.1)  # validates the autoscale settings

    def autoscale_config(self, ttft_slo_s: float, itl_slo_s: float) -> AutoscaleConfig:
        """The autoscaler's settings, held to the telemetry's SLO flags."""
        return AutoscaleConfig(
            interval_s=self.autoscale_interval_s, ttft_p90_s=ttft_slo_s,
            queued_tokens_per_worker=self.autoscale_queued_tokens, itl_p90_s=itl_slo_s,
            kv_utilization=self.autoscale_kv_utilization,
            down_window_s=self.autoscale_down_window_s,
            up_cooldown_s=self.autoscale_up_cooldown_s,
            down_cooldown_s=self.autoscale_down_cooldown_s,
            max_prefill=self.autoscale_max_prefill, max_decode=self.autoscale_max_decode,
        )  # fmt: skip
