"""The driver's side of a pdserve cluster on Ray: connect, start, scale, stop.

Lifecycle: `connect(address, namespace, ...)` joins a Ray cluster (or starts a local one
bound to 127.0.0.1 when no address is given, with enough logical CPUs for the actors
asked for). `RayCluster(cluster, ray_cfg, telemetry).start()` creates the named controller
actor (`pdserve-controller`, owned by this process) and has it start every service;
it returns the gateway address. `scale_pool(namespace, pool, n)` finds the controller by
name from any process connected to the same Ray cluster (`pdserve scale`). `stop()`
drains everything and kills the controller; if this process dies instead, Ray kills the
controller it owned and, with it, every actor the controller owned.
"""

from __future__ import annotations

import math
import os
from typing import Any

import ray

from services.cluster.config import ClusterConfig
from services.common.config import pdserve_env
from services.common.telemetry_config import TelemetryConfig
from services.ray.config import RayConfig
from services.ray.controller import CONTROLLER_NAME, ClusterController


def local_cpus(cluster: ClusterConfig, ray_cfg: RayConfig) -> int:
    """Logical CPUs a local Ray needs so every actor of the cluster can be placed."""
    workers = (cluster.num_prefill + cluster.num_decode) * ray_cfg.worker_cpus
    services = (ray_cfg.num_routers + 1) * ray_cfg.service_cpus
    return max(os.cpu_count() or 1, math.ceil(workers + services))


def connect(
    address: str,
    namespace: str,
    *,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    object_store_memory: int | None = None,
) -> None:
    """Join the Ray cluster at `address`, or start a local one when it is empty."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        return
    _loopback_only()
    ray.init(
        namespace=namespace,
        num_cpus=num_cpus,
        resources=resources,
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )


def _loopback_only() -> None:
    """Keep a local Ray, and the services in it, on 127.0.0.1.

    On Linux Ray swaps a loopback node address for the machine's outward IP, so that other
    nodes could join; a local cluster has none, and its services should not listen on an
    outside interface. Ray reads this switch when it picks the node address: its child
    processes inherit the variable, this process reads the constant.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def _controller(namespace: str) -> Any:
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError as exc:
        raise ValueError(
            f"ray_namespace: no pdserve cluster runs in Ray namespace {namespace!r} "
            "(start one with `pdserve up --ray`)"
        ) from exc


class RayCluster:
    def __init__(
        self, cluster: ClusterConfig, ray_cfg: RayConfig, telemetry: TelemetryConfig | None = None
    ) -> None:
        self.cluster = cluster
        self.ray_cfg = ray_cfg
        self.telemetry = telemetry or TelemetryConfig()
        self.controller: Any = None
        self.gateway_address = ""

    def start(self) -> str:
        """Create the controller and start every service; returns the gateway address."""
        namespace = self.ray_cfg.ray_namespace
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=namespace)
        except ValueError:
            pass
        else:
            raise ValueError(
                f"ray_namespace: a pdserve cluster already runs in Ray namespace {namespace!r}"
            )
        self.controller = (
            ray.remote(ClusterController)
            .options(name=CONTROLLER_NAME, namespace=namespace, num_cpus=0, max_restarts=0)
            .remote(self.cluster, self.ray_cfg, self.telemetry, pdserve_env())
        )
        timeout = self.cluster.startup_timeout_s * 2 + 60
        try:
            self.gateway_address = str(ray.get(self.controller.start.remote(), timeout=timeout))
        except BaseException:
            self.stop()
            raise
        return self.gateway_address

    def scale(self, pool: str, replicas: int) -> list[str]:
        return scale_pool(self.ray_cfg.ray_namespace, pool, replicas)

    def status(self) -> dict[str, Any]:
        return dict(ray.get(self.controller.status.remote()))

    def stop(self) -> None:
        """Drain and stop every service, then the controller. Idempotent."""
        controller, self.controller = self.controller, None
        if controller is None:
            return
        try:
            ray.get(controller.shutdown.remote(), timeout=300)
        finally:
            ray.kill(controller, no_restart=True)


def scale_pool(namespace: str, pool: str, replicas: int) -> list[str]:
    """Resize a pool of the cluster in `namespace`; returns the pool's worker ids."""
    return list(ray.get(_controller(namespace).scale.remote(pool, replicas)))
