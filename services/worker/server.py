"""One worker process: an engine, its loop thread, KV transfer and the Worker service.

Lifecycle: `serve_worker(worker, engine, transfer)` loads the engine (converting the
default model on first use), starts the engine loop, what its home role runs (`Phases`:
the KV exporter for prefill, the importer for decode; a mixed worker needs neither;
every role decodes), and the gRPC server with health and reflection; registers with the
router's Redis when `--redis-url` is set (refused if its model or KV layout differs from
the cluster's; before that it runs two short prefills, `calibration.py`, so its first
signal carries a measured prefill speed), then publishes its load signal there every
`signal_interval_s` (`signal_publisher.py`) and, with `--role-window-s` > 0, lets the
role planner change its home role as the mix shifts (`home_role.py`; the SetRole RPC
changes it by hand); prints one JSON line `{"ready": address, ...}` on stdout for
whoever launched it; serves until SIGTERM or SIGINT. Then it drains: marks itself
draining in the registry (no new requests) and withdraws its load signal, reports
NOT_SERVING, lets running streams finish and exported KV be pulled for up to
`drain_timeout_s`, deregisters, and stops everything (remaining leases released).
Telemetry (`Telemetry`, `WorkerTelemetry`) starts first and stops last: the metrics
endpoint's port goes into the ready line, and queued spans are flushed at exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager

import grpc

from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvtransfer.config import TransferConfig
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import announce_ready, build_server, wait_for_shutdown_signal
from services.common.log_format import log_context
from services.common.role import Role
from services.common.status import abort_with, status_for
from services.common.telemetry import Telemetry
from services.common.telemetry_config import TelemetryConfig
from services.common.tls import TlsConfig, channel_security
from services.common.tracing import trace_id_from_metadata
from services.engine_host.loop import EngineLoop
from services.engine_host.telemetry import WorkerTelemetry
from services.router.keyspace import Keyspace
from services.router.registry import WorkerInfo
from services.router.residency import ResidencyBoard
from services.router.worker_signal import SignalBoard
from services.worker.calibration import Calibration, calibrate
from services.worker.config import WorkerConfig
from services.worker.home_role import ChangeReason, HomeRole
from services.worker.phases import Phases
from services.worker.registration import WorkerRegistration
from services.worker.residency_feed import ResidencyFeed
from services.worker.role_planner import RolePlanner
from services.worker.signal_publisher import SignalPublisher, signal_ttl_s

log = logging.getLogger(__name__)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Routes RPCs to the role's handlers; every error becomes a typed status."""

    def __init__(
        self,
        config: WorkerConfig,
        loop: EngineLoop,
        home: HomeRole,
        address: str,
        telemetry: WorkerTelemetry | None = None,
    ) -> None:
        self.telemetry = telemetry or WorkerTelemetry.disabled(config.worker_id)
        self.config = config
        self.loop = loop
        self.home = home
        self.phases = home.phases
        self.address = address
        self.worker_id = config.worker_id

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        handler = self.phases.prefill
        if handler is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker role is {self.home.role}: it has never prefilled for a decode worker",
            )
        assert handler is not None
        self.phases.prefill_calls += 1
        try:
            with _log_context(request.request_id, context):
                return await handler.prefill(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            self.telemetry.count_error(status_for(exc)[0])
            await abort_with(context, exc)
            raise

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeChunk]:
        try:
            async for chunk in self.phases.decode.decode(request, context):
                yield chunk
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            self.telemetry.count_error(status_for(exc)[0])
            await abort_with(context, exc)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        prefill = self.phases.prefill
        found = prefill.abort(request.request_id) if prefill else False
        if not found:
            self.loop.engine.abort(request.request_id)
            self.loop.wake()
        return worker_pb2.AbortResponse(found=found)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return worker_stats(self)

    async def SetRole(
        self, request: worker_pb2.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.SetRoleResponse:
        try:
            role = Role.parse(request.role)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"SetRole.role: {exc}")
            raise
        if self.home.registration is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "SetRole needs a registry: this worker was started without --redis-url, so "
                "its gateway's static addresses fix its role",
            )
        try:
            previous = await self.home.change(role, ChangeReason.OPERATOR)
        except Exception as exc:
            self.telemetry.count_error(status_for(exc)[0])
            await abort_with(context, exc)
            raise
        return worker_pb2.SetRoleResponse(previous=previous, role=role)


def _log_context(
    request_id: str, context: grpc.aio.ServicerContext
) -> AbstractContextManager[None]:
    """Log records inside carry the request id and the caller's trace id."""
    return log_context(request_id, trace_id_from_metadata(context.invocation_metadata()))


def worker_stats(svc: WorkerService) -> worker_pb2.WorkerStats:
    s = svc.loop.engine.stats()
    exporter = svc.phases.exporter
    leases = exporter.stats().leases if exporter else None
    return worker_pb2.WorkerStats(
        worker_id=svc.worker_id, role=svc.home.role, total_blocks=s.total_blocks,
        free_blocks=s.free_blocks, used_blocks=s.used_blocks, cached_blocks=s.cached_blocks,
        held_blocks=s.held_blocks, running=s.running, waiting=s.waiting,
        active_leases=leases.active if leases else 0,
        expired_leases=leases.expired if leases else 0,
        prefix_hit_tokens=s.prefix_hit_tokens, prefix_query_tokens=s.prefix_query_tokens,
        kv_layout_fingerprint=svc.loop.engine.layout.fingerprint(), address=svc.address,
        offload_blocks=s.offload_blocks, offload_capacity_blocks=s.offload_capacity_blocks,
        lora_adapters=list(s.lora_resident), lora_held=s.lora_held,
    )  # fmt: skip


async def serve_worker(
    config: WorkerConfig,
    engine_cfg: EngineConfig,
    transfer: TransferConfig,
    telemetry_cfg: TelemetryConfig | None = None,
    tls: TlsConfig | None = None,
) -> None:
    tls = tls or TlsConfig()
    security = channel_security(tls)
    if not config.worker_id:
        config = WorkerConfig(**{**config.__dict__, "worker_id": f"{config.role}-{os.getpid()}"})
    telemetry = Telemetry.start(
        telemetry_cfg or TelemetryConfig(), f"pdserve-{config.role}", config.worker_id
    )
    # A bar only where a person watches: weight packing or quantization takes seconds.
    engine = LLMEngine(engine_cfg, progress=sys.stderr.isatty())
    observe = WorkerTelemetry.on(telemetry, engine, config.worker_id)
    # Its load signal is published: give it a measured speed first.
    calibration = await asyncio.to_thread(calibrate, engine) if config.redis_url else None
    loop = EngineLoop(engine).start(asyncio.get_running_loop())
    phases = Phases(loop, transfer, config.worker_id, security, observe)
    phases.serve(config.role)
    home = HomeRole(config.role, phases, observe)
    built = build_server(
        config.host,
        config.port,
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        tls=tls,
    )
    address = f"{config.host}:{built.port}"
    service = WorkerService(config, loop, home, address, observe)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, built.server)
    await built.server.start()
    registration = await _register(config, engine, address)
    publisher = _publish_signal(config, engine, registration, calibration)
    _plan_roles(config, home, registration, publisher)
    await built.mark_serving()
    announce_ready(ready=address, worker_id=config.worker_id, role=config.role,
                   **telemetry.ready_fields())  # fmt: skip
    await wait_for_shutdown_signal()
    log.info("worker %s draining", config.worker_id)
    await home.stop()  # no role change while it drains
    if registration is not None:
        await registration.drain()
    if publisher is not None:
        await publisher.stop()
    await built.mark_not_serving()
    await _wait_idle(engine, phases, config.drain_timeout_s)
    if registration is not None:
        await registration.stop()
    await built.server.stop(grace=1.0)
    loop.stop()
    phases.close()
    telemetry.close()
    sys.stdout.flush()


async def _register(
    config: WorkerConfig, engine: LLMEngine, address: str
) -> WorkerRegistration | None:
    if not config.redis_url:
        return None
    info = WorkerInfo(
        worker_id=config.worker_id, role=config.role, model=engine.spec.fingerprint,
        layout_fingerprint=engine.layout.fingerprint(), address=address,
        capacity=engine.pool.num_blocks, incarnation=uuid.uuid4().hex[:12],
        identity=engine.spec.identity, layout_text=engine.layout.describe(),
    )  # fmt: skip
    registration = WorkerRegistration(
        config.redis_url, config.pool_namespace, config.heartbeat_ttl_s, info,
        adapters=lambda: engine.loras.counts().resident,
    )  # fmt: skip
    await registration.start()
    return registration


def _publish_signal(
    config: WorkerConfig,
    engine: LLMEngine,
    registration: WorkerRegistration | None,
    calibration: Calibration | None,
) -> SignalPublisher | None:
    """Publish the worker's load signal next to its registration (sharing its Redis
    client), so the gateway's readers find it through the pool the worker is in; its
    speeds count from the calibration's baseline. Its prefix cache is reported with it
    (`ResidencyFeed`), under the registration's incarnation."""
    if registration is None:
        return None
    keys = Keyspace(config.pool_namespace)
    ttl_s = signal_ttl_s(config.signal_interval_s)
    client = registration.registry.client
    board = SignalBoard(client, keys, ttl_s=ttl_s)
    feed = ResidencyFeed(ResidencyBoard(client, keys, ttl_s), engine.residency,
                         config.worker_id, registration.info.incarnation)  # fmt: skip
    publisher = SignalPublisher(
        board, engine.stats, config.worker_id, config.role, config.signal_interval_s
    ).report_cache(feed)
    if calibration is not None:
        publisher.count_from(calibration.baseline)
    return publisher.start()


def _plan_roles(
    config: WorkerConfig,
    home: HomeRole,
    registration: WorkerRegistration | None,
    publisher: SignalPublisher | None,
) -> None:
    """Give the home role its registration and publisher (SetRole moves them too), and
    start the role planner where the mix may move it: with a registry, a window, and a
    prefill or decode home role (a mixed worker has no split to bend)."""
    if registration is None or config.role_window_s <= 0 or config.role is Role.MIXED:
        home.attach(registration, publisher)
        return
    planner = RolePlanner(config.worker_id, config.role_window_s, config.role_long_prompt_tokens)
    home.attach(registration, publisher, planner).start()


async def _wait_idle(engine: LLMEngine, phases: Phases, timeout: float) -> None:
    """Let running streams finish and exported KV be pulled, up to `timeout` seconds."""
    end = asyncio.get_running_loop().time() + timeout
    exporter = phases.exporter
    while asyncio.get_running_loop().time() < end:
        busy = engine.has_unfinished() or (exporter is not None and exporter.stats().leases.active)
        if not busy:
            return
        await asyncio.sleep(0.05)
    log.warning("drain timeout: stopping with requests still running")
