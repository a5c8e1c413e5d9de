"""The cluster's controller: one named Ray actor that owns every pdserve actor.

Lifecycle: the launcher creates `ClusterController` as the named actor
`pdserve-controller` in the cluster's Ray namespace and calls `start()`: it starts (or
uses) the router's Redis, the Router service actors, both worker pools, waits until every
worker serves (each has registered with Redis by then), then starts the gateway, which
places through the router library on the same Redis, and returns the gateway address.
`scale(pool, n)` adds workers (new actors, waited on until they serve) or removes the
newest ones (drained first, like SIGTERM, then killed). `autoscale(cfg)` starts (or, with
None, stops) the SLO-driven autoscaler (`autoscaler.py`), a thread calling the same
`scale`; `start()` starts it when `--autoscale` is on. `shutdown()` stops it, the gateway,
drains the workers and routers, and stops the embedded Redis. The controller owns the
actors it creates, so if it dies Ray tears them down with it; it is itself owned by the
`pdserve up --ray` process (or the test) that created it.

Actor names: `pdserve-gateway`, `pdserve-router-<i>`, `pdserve-<role>-<i>`; a worker's
id is `<role>-<i>`, kept across restarts.
"""

from __future__ import annotations

import logging
import shlex
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from engine.config import EngineConfig
from kvtransfer.config import TransferConfig
from services.cluster.config import ClusterConfig
from services.common.config import config_from_env, config_with_args
from services.common.model_config import ModelConfig
from services.common.role import Role
from services.common.telemetry_config import TelemetryConfig
from services.gateway.config import GatewayConfig
from services.ray.actors import ServiceActor, ServiceSpec
from services.ray.autoscaler import AutoscaleConfig, AutoscaleLoop, PoolName, SignalReader
from services.ray.config import RayConfig, parse_resources
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.redis_ha import EmbeddedRedisHA
from services.router.router_config import RouterConfig
from services.router.worker_signal import SignalBoard
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)

CONTROLLER_NAME = "pdserve-controller"
STOP_TIMEOUT_S = 60.0


def actor_name(service: str) -> str:
    return f"pdserve-{service}"


@dataclass
class Pool:
    role: str  # prefill, decode or mixed
    gpus: float
    resources: dict[str, float]
    actors: dict[int, Any] = field(default_factory=dict)  # index -> actor handle


class ClusterController:
    def __init__(
        self,
        cluster: ClusterConfig,
        ray_cfg: RayConfig,
        telemetry: TelemetryConfig,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: the launcher's `PDSERVE_*` env vars, which fill the worker engines'
        settings the cluster leaves unset (None: none)."""
        if cluster.extra_models or cluster.served_model_name or cluster.lora_dir:
            # Each model's pool would need its own actors, scaling and autoscaler, and each
            # node the adapters' directory: not yet.
            raise ValueError(
                "extra_models, served_model_name and lora_dir are not supported with --ray "
                "yet: run them locally"
            )
        self.cluster = cluster
        self.ray_cfg = ray_cfg
        self.env = env or {}
        # Every service picks its own metrics port: several may share a node.
        self.telemetry = telemetry
        if telemetry.metrics_port > 0:
            self.telemetry = TelemetryConfig(**{**telemetry.__dict__, "metrics_port": 0})
        self.redis: EmbeddedRedis | EmbeddedRedisHA | None = None
        self.redis_url = ray_cfg.redis_url
        decode_role = "decode" if cluster.num_prefill else "mixed"
        self.pools = {
            "prefill": Pool("prefill", ray_cfg.prefill_gpus,
                            parse_resources(ray_cfg.prefill_resources)),
            "decode": Pool(decode_role, ray_cfg.decode_gpus,
                           parse_resources(ray_cfg.decode_resources)),
        }  # fmt: skip
        self.routers: list[Any] = []
        self.gateway: Any = None
        self.gateway_address = ""
        self.http_address = ""
        self.gateway_metrics_port: int | None = None
        self.autoscaler: AutoscaleLoop | None = None
        self._scale_lock = threading.Lock()  # the autoscaler's thread and callers both scale

    # -- start ---------------------------------------------------------------------

    def start(self) -> str:
        """Start every service; returns the gateway address. Stops all on failure."""
        try:
            self._start_redis()
            routers = range(self.ray_cfg.num_routers)
            self.routers = [self._spawn(self._router_spec(i)) for i in routers]
            # Both pools load their models at once; the gateway starts when all serve.
            workers = self._grow(self.pools["prefill"], self.cluster.num_prefill)
            workers += self._grow(self.pools["decode"], self.cluster.num_decode)
            self._wait([*self.routers, *workers])
            self.gateway = self._spawn(self._gateway_spec())
            self.gateway_address = self._wait([self.gateway])[0]
            fields = ray.get(self.gateway.ready_fields.remote(self.cluster.startup_timeout_s))
            self.http_address = str(fields.get("http", ""))
            self.gateway_metrics_port = fields.get("metrics_port")
            if self.ray_cfg.autoscale:
                t = self.telemetry
                self.autoscale(self.ray_cfg.autoscale_config(t.slo_ttft_s, t.slo_itl_s))
            return self.gateway_address
        except BaseException:
            self.shutdown()
            raise

    def _start_redis(self) -> None:
        if self.redis_url:
            return
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) > 1:
            raise ValueError(
                f"redis_url: the embedded Redis listens on 127.0.0.1 of one node and this Ray "
                f"cluster has {len(nodes)}; give --redis-url of a Redis every node reaches"
            )
        self.redis = EmbeddedRedisHA() if self.cluster.redis_ha else EmbeddedRedis(tcp=True)
        self.redis_url = self.redis.start().url

    def _options(self, name: str, *, cpus: float, gpus: float = 0.0,
                 resources: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
        return {
            "name": actor_name(name),
            "namespace": self.ray_cfg.ray_namespace,
            "num_cpus": cpus,
            "num_gpus": gpus,
            "resources": resources or {},
            "max_restarts": self.ray_cfg.max_restarts,
            "max_task_retries": 0,
        }

    def _spawn(self, spec: ServiceSpec) -> Any:
        if spec.kind == "worker":
            pool = self.pools["prefill" if spec.name.startswith("prefill") else "decode"]
            opts = self._options(spec.name, cpus=self.ray_cfg.worker_cpus, gpus=pool.gpus,
                                 resources=pool.resources)  # fmt: skip
        else:
            opts = self._options(spec.name, cpus=self.ray_cfg.service_cpus)
        return ray.remote(ServiceActor).options(**opts).remote(spec)

    def _wait(self, actors: list[Any]) -> list[str]:
        timeout = self.cluster.startup_timeout_s
        return list(ray.get([a.address.remote(timeout) for a in actors], timeout=timeout + 30))

    # -- specs ---------------------------------------------------------------------

    def _router_cfg(self) -> RouterConfig:
        return RouterConfig(redis_url=self.redis_url, namespace=self.ray_cfg.ray_namespace)

    def _router_spec(self, index: int) -> ServiceSpec:
        return ServiceSpec(f"router-{index}", "router", (self._router_cfg(), self.telemetry))

    def _gateway_spec(self) -> ServiceSpec:
        c = self.cluster
        # As `pdserve up`: a fixed HTTP port only beside a fixed gRPC port.
        http_port = c.http_port if c.http_port is not None else 8471 if c.gateway_port else 0
        gateway = GatewayConfig(gateway_port=c.gateway_port, placement="redis",
                                max_streams=c.max_streams, http_port=http_port)  # fmt: skip
        if c.local_prefill_max_tokens is not None:
            gateway = replace(gateway, local_prefill_max_tokens=c.local_prefill_max_tokens)
        # `--gateway-args` as on a local cluster (GatewayConfig flags only: the gateway
        # actor is built here, not from a command line).
        gateway = config_with_args(gateway, shlex.split(c.gateway_args))
        model = ModelConfig(model=c.model, model_cache_dir=c.model_cache_dir)
        return ServiceSpec("gateway", "gateway", (gateway, model, self._router_cfg(),
                                                  self.telemetry))  # fmt: skip

    def _worker_spec(self, pool: Pool, index: int) -> ServiceSpec:
        c = self.cluster
        name = f"{pool.role}-{index}"
        # The autoscaler sizes each pool by its launched role; a home role that moved
        # under it would have it drain a prefill actor that is decoding. So one or the
        # other: with --autoscale, home roles stay fixed (deploy.md, one pool or two).
        window = 0.0 if self.ray_cfg.autoscale else WorkerConfig.role_window_s
        worker = WorkerConfig(role=Role(pool.role), worker_id=name, redis_url=self.redis_url,
                              namespace=self.ray_cfg.ray_namespace,
                              role_window_s=window)  # fmt: skip
        # As a local cluster's worker process reads its PDSERVE_* env vars for what its
        # flags leave unset, a worker actor's engine takes them from the launcher's
        # environment; what the cluster sets wins.
        chosen = {"dtype": c.dtype, "quantization": c.quantization,
                  "kv_cache_dtype": c.kv_cache_dtype,
                  "speculative_decoding": c.speculative_decoding}  # fmt: skip
        values = {"model": c.model, "model_cache_dir": c.model_cache_dir,
                  "kv_cache_bytes": c.worker_kv_cache_bytes, "num_threads": c.worker_threads,
                  "device": "cuda" if pool.gpus > 0 else "cpu",
                  **{k: v for k, v in chosen.items() if v is not None}}  # fmt: skip
        engine = config_from_env(EngineConfig, values, self.env)
        transfer = TransferConfig(kv_backend=c.kv_backend)
        return ServiceSpec(name, "worker", (worker, engine, transfer, self.telemetry))

    # -- scale ---------------------------------------------------------------------

    def scale(self, pool_name: str, replicas: int) -> list[str]:
        """Resize a pool to `replicas` workers; returns its worker ids once they serve."""
        with self._scale_lock:
            return self._scale(pool_name, replicas)

    def _scale(self, pool_name: str, replicas: int) -> list[str]:
        pool = self._pool(pool_name, replicas)
        current = sorted(pool.actors)
        if replicas > len(current):
            added = self._grow(pool, replicas)
            try:
                self._wait(added)
            except BaseException:
                self._remove(pool, [i for i, a in pool.actors.items() if a in added])
                raise
        elif replicas < len(current):
            self._remove(pool, current[replicas:])
        return self._ids(pool)

    def _grow(self, pool: Pool, replicas: int) -> list[Any]:
        """Start actors for the lowest free indexes up to `replicas`; returns them."""
        free = [i for i in range(replicas + len(pool.actors)) if i not in pool.actors]
        added = {
            i: self._spawn(self._worker_spec(pool, i))
            for i in free[: max(0, replicas - len(pool.actors))]
        }
        pool.actors.update(added)
        return list(added.values())

    @staticmethod
    def _ids(pool: Pool) -> list[str]:
        return [f"{pool.role}-{i}" for i in sorted(pool.actors)]

    def _pool(self, name: str, replicas: int) -> Pool:
        key = "decode" if name == "mixed" else name
        if key not in self.pools:
            raise ValueError(f"pool must be prefill or decode, got {name!r}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        mixed = self.pools["decode"].role == "mixed"
        if key == "prefill" and mixed and replicas:
            raise ValueError("prefill: this cluster runs mixed workers (--num-prefill 0)")
        if self.gateway is not None and replicas == 0 and not (key == "prefill" and mixed):
            raise ValueError(f"replicas: the {key} pool needs at least 1 worker while serving")
        return self.pools[key]

    def _remove(self, pool: Pool, indexes: list[int]) -> None:
        """Drain then kill; the worker deregisters itself while draining."""
        actors = [pool.actors.pop(i) for i in indexes if i in pool.actors]
        self._stop(actors)

    @staticmethod
    def _stop(actors: list[Any]) -> None:
        pending = [a.stop.remote(STOP_TIMEOUT_S) for a in actors]
        try:
            ray.get(pending, timeout=STOP_TIMEOUT_S + 10)
        except Exception as exc:  # a dead or stuck actor: killing it is what is left
            log.warning("stopping actors: %s", exc)
        for actor in actors:
            ray.kill(actor, no_restart=True)

    # -- autoscaling ---------------------------------------------------------------

    def autoscale(self, cfg: AutoscaleConfig | None) -> dict[str, Any]:
        """Start the autoscaler with `cfg` (replacing a running one), or stop it (None);
        returns its status."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
            self.autoscaler = None
        if cfg is None:
            return {}
        if self.gateway_metrics_port is None:
            raise ValueError("autoscale: the gateway serves no /metrics (metrics_port < 0)")
        board = SignalBoard(connect(self.redis_url), Keyspace(self.ray_cfg.ray_namespace))
        host = self.gateway_address.rpartition(":")[0] or "127.0.0.1"
        reader = SignalReader.for_gateway(board, host, self.gateway_metrics_port)
        mixed = self.pools["decode"].role == "mixed"
        pools = (PoolName.DECODE,) if mixed else (PoolName.PREFILL, PoolName.DECODE)
        self.autoscaler = AutoscaleLoop(cfg, reader, self._sizes, self._autoscale_to, pools)
        self.autoscaler.start()
        return self.autoscaler.status()

    def _sizes(self) -> dict[PoolName, int]:
        return {p: len(self.pools[p.value].actors) for p in PoolName}

    def _autoscale_to(self, pool: PoolName, replicas: int) -> None:
        self.scale(pool.value, replicas)

    # -- status and shutdown -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "gateway": self.gateway_address,
            "http": self.http_address,
            "redis_url": self.redis_url,
            "redis_pid": self.redis.pid if self.redis is not None else None,
            "routers": len(self.routers),
            "pools": {k: self._ids(p) for k, p in self.pools.items()},
            "autoscale": self.autoscaler.status() if self.autoscaler is not None else None,
        }

    def pids(self) -> list[int]:
        """Process ids of every service actor (the embedded Redis excluded)."""
        actors = [*self.routers, *([self.gateway] if self.gateway else [])]
        actors += [a for pool in self.pools.values() for a in pool.actors.values()]
        return list(ray.get([a.pid.remote() for a in actors]))

    def shutdown(self) -> None:
        """Autoscaler first, then the gateway (no new requests), workers (drained),
        routers, Redis."""
        self.autoscale(None)
        if self.gateway is not None:
            self._stop([self.gateway])
            self.gateway = None
        for pool in self.pools.values():
            self._remove(pool, sorted(pool.actors))
        self._stop(self.routers)
        self.routers = []
        if self.redis is not None:
            self.redis.close()
            self.redis = None
