"""The Ray actor that runs one pdserve service, and the specs the controller gives it.

Lifecycle of a `ServiceActor`: Ray constructs it on a node that has the resources it
asked for (GPUs, CPUs, custom resources); `__init__` binds the service to that node's IP
and starts it on a `ServiceHost` thread with the same serve function `pdserve worker`,
`pdserve gateway` or `pdserve router` runs, so a worker loads its engine and registers
with the router's Redis as it would anywhere. `address()` waits until it serves.
`stop()` drains it like SIGTERM. If the service dies on its own after it served, the
actor exits its process, so Ray restarts it (up to `max_restarts`): `__init__` runs again
with the same spec, and the worker comes back under the same worker id, re-registering
with its new address. `ray.kill(actor, no_restart=False)` takes the same path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from kvtransfer.config import TransferConfig
from services.common.model_config import ModelConfig
from services.common.telemetry_config import TelemetryConfig
from services.gateway.config import GatewayConfig
from services.ray.service_host import ServiceHost
from services.router.router_config import RouterConfig
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)

KINDS = ("worker", "gateway", "router")


@dataclass(frozen=True)
class ServiceSpec:
    """What one actor runs. `configs` are the serve function's config arguments in order:
    worker (WorkerConfig, EngineConfig, TransferConfig, TelemetryConfig), gateway
    (GatewayConfig, ModelConfig, RouterConfig, TelemetryConfig), router (RouterConfig,
    TelemetryConfig). Hosts are filled in on the node the actor lands on."""

    name: str
    kind: str
    configs: tuple[Any, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


def serve_coroutine(spec: ServiceSpec, host: str) -> Coroutine[Any, Any, None]:
    """The service's serve coroutine, bound to `host` (this node's IP)."""
    if spec.kind == "worker":
        from services.worker.server import serve_worker

        worker, engine, transfer, telemetry = spec.configs
        assert isinstance(worker, WorkerConfig) and isinstance(engine, EngineConfig)
        assert isinstance(transfer, TransferConfig) and isinstance(telemetry, TelemetryConfig)
        return serve_worker(
            dataclasses.replace(worker, host=host),
            engine,
            dataclasses.replace(transfer, kv_transfer_host=host),
            telemetry,
        )
    if spec.kind == "gateway":
        from services.gateway.server import serve_gateway

        gateway, model, router, telemetry = spec.configs
        assert isinstance(gateway, GatewayConfig) and isinstance(model, ModelConfig)
        assert isinstance(router, RouterConfig) and isinstance(telemetry, TelemetryConfig)
        return serve_gateway(dataclasses.replace(gateway, gateway_host=host), model, router,
                             telemetry)  # fmt: skip
    from services.router.service import serve_router

    router, telemetry = spec.configs
    assert isinstance(router, RouterConfig) and isinstance(telemetry, TelemetryConfig)
    return serve_router(host, 0, router, telemetry)


def node_ip() -> str:
    """The address Ray knows this actor's node by (127.0.0.1 for a local cluster)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


class ServiceActor:
    """Wrapped with `ray.remote(...).options(...)` by the controller (see launcher)."""

    def __init__(self, spec: ServiceSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        self.spec = spec
        host = node_ip()
        self.host = ServiceHost(spec.name, lambda: serve_coroutine(spec, host)).start()
        threading.Thread(target=self._exit_on_crash, name="pdserve-watch", daemon=True).start()

    def _exit_on_crash(self) -> None:
        self.host.done.wait()
        served = self.host.control.ready.done() and self.host.control.ready.exception() is None
        if self.host.crashed and served:
            # Leave the process so Ray restarts the actor (a failure counts against
            # max_restarts). A service that never got ready stays down and reports its
            # error through address() instead of crash-looping.
            log.error("service %s died after serving; exiting for a restart", self.spec.name)
            os._exit(1)

    def address(self, timeout_s: float) -> str:
        return str(self.host.wait_ready(timeout_s)["ready"])

    def ready_fields(self, timeout_s: float) -> dict[str, Any]:
        return self.host.wait_ready(timeout_s)

    def stop(self, timeout_s: float) -> bool:
        return self.host.stop(timeout_s)

    def pid(self) -> int:
        return os.getpid()
