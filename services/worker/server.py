"""One worker process: an engine, its loop thread, KV transfer and the Worker service.

Lifecycle: `serve_worker(worker, engine, transfer)` loads the engine (converting the
default model on first use), starts the engine loop, the KV exporter (prefill role) or
importer (decode role; a mixed worker needs neither; every role decodes), and the gRPC
server with health and reflection; registers with the router's Redis when
`--redis-url` is set (refused if its model or KV layout differs from the cluster's) and
then publishes its load signal there every `signal_interval_s` (`signal_publisher.py`);
prints one JSON line `{"ready": address, ...}` on stdout for whoever launched it; serves
until SIGTERM or SIGINT. Then it drains: marks itself draining in the registry (no new requests) and
withdraws its load signal, reports NOT_SERVING, lets running streams finish and exported
KV be pulled for up to `drain_timeout_s`, deregisters, and stops everything (remaining
leases released).
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
from dataclasses import dataclass

import grpc

from engine.config import EngineConfig
from engine.engine import LLMEngine
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import KvImporter
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import announce_ready, build_server, wait_for_shutdown_signal
from services.common.log_format import log_context
from services.common.status import abort_with, status_for
from services.common.telemetry import Telemetry
from services.common.telemetry_config import TelemetryConfig
from services.common.tls import TlsConfig, channel_security
from services.common.tracing import trace_id_from_metadata
from services.decode.handler import DecodeHandler
from services.engine_host.loop import EngineLoop
from services.engine_host.telemetry import WorkerTelemetry
from services.prefill.handler import PrefillHandler
from services.router.keyspace import Keyspace
from services.router.registry import WorkerInfo
from services.router.worker_signal import SignalBoard
from services.worker.config import WorkerConfig
from services.worker.registration import WorkerRegistration
from services.worker.signal_publisher import SignalPublisher, signal_ttl_s

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleParts:
    """What the worker's role serves: a Prefill handler and its KV exporter (prefill
    role), a Decode handler (every role: a prefill worker's serves whole requests only,
    with no KV to import)."""

    prefill: PrefillHandler | None
    decode: DecodeHandler
    exporter: KvExporter | None


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Routes RPCs to the role's handlers; every error becomes a typed status."""

    def __init__(
        self,
        config: WorkerConfig,
        loop: EngineLoop,
        role: RoleParts,
        address: str,
        telemetry: WorkerTelemetry | None = None,
    ) -> None:
        self.telemetry = telemetry or WorkerTelemetry.disabled(config.worker_id)
        self.config = config
        self.loop = loop
        self.prefill_handler = role.prefill
        self.decode_handler = role.decode
        self.exporter = role.exporter
        self.address = address
        self.worker_id = config.worker_id

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        if self.prefill_handler is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"worker role is {self.config.role}"
            )
        assert self.prefill_handler is not None
        try:
            with _log_context(request.request_id, context):
                return await self.prefill_handler.prefill(request, context)
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
            async for chunk in self.decode_handler.decode(request, context):
                yield chunk
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            self.telemetry.count_error(status_for(exc)[0])
            await abort_with(context, exc)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        found = self.prefill_handler.abort(request.request_id) if self.prefill_handler else False
        if not found:
            self.loop.engine.abort(request.request_id)
            self.loop.wake()
        return worker_pb2.AbortResponse(found=found)

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return worker_stats(self)


def _log_context(
    request_id: str, context: grpc.aio.ServicerContext
) -> AbstractContextManager[None]:
    """Log records inside carry the request id and the caller's trace id."""
    return log_context(request_id, trace_id_from_metadata(context.invocation_metadata()))


def worker_stats(svc: WorkerService) -> worker_pb2.WorkerStats:
    s = svc.loop.engine.stats()
    leases = svc.exporter.stats().leases if svc.exporter else None
    return worker_pb2.WorkerStats(
        worker_id=svc.worker_id, role=svc.config.role, total_blocks=s.total_blocks,
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
    loop = EngineLoop(engine).start(asyncio.get_running_loop())
    exporter = importer = None
    if config.role == "prefill":
        exporter = KvExporter(
            engine.handoff, transfer, engine_id=config.worker_id, security=security
        ).start()
    if config.role == "decode":
        importer = KvImporter(
            engine.handoff, transfer, engine_id=config.worker_id, security=security
        )
    built = build_server(
        config.host,
        config.port,
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        tls=tls,
    )
    address = f"{config.host}:{built.port}"
    prefill = PrefillHandler(loop, exporter, config.worker_id, observe) if exporter else None
    # Every role decodes: a prefill worker with room serves short requests whole when the
    # gateway's elastic roles send them (no KV import there, so no importer).
    decode = DecodeHandler(loop, importer, observe)
    role = RoleParts(prefill, decode, exporter)
    service = WorkerService(config, loop, role, address, observe)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, built.server)
    await built.server.start()
    registration = await _register(config, engine, address)
    publisher = _publish_signal(config, engine, registration)
    await built.mark_serving()
    announce_ready(ready=address, worker_id=config.worker_id, role=config.role,
                   **telemetry.ready_fields())  # fmt: skip
    await wait_for_shutdown_signal()
    log.info("worker %s draining", config.worker_id)
    if registration is not None:
        await registration.drain()
    if publisher is not None:
        await publisher.stop()
    await built.mark_not_serving()
    await _wait_idle(engine, exporter, config.drain_timeout_s)
    if registration is not None:
        await registration.stop()
    await built.server.stop(grace=1.0)
    loop.stop()
    if exporter:
        exporter.close()
    if importer:
        importer.close()
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
        identity=engine.spec.identity,
    )  # fmt: skip
    registration = WorkerRegistration(
        config.redis_url, config.pool_namespace, config.heartbeat_ttl_s, info,
        adapters=lambda: engine.loras.counts().resident,
    )  # fmt: skip
    await registration.start()
    return registration


def _publish_signal(
    config: WorkerConfig, engine: LLMEngine, registration: WorkerRegistration | None
) -> SignalPublisher | None:
    """Publish the worker's load signal next to its registration (sharing its Redis
    client), so the gateway's readers find it through the pool the worker is in."""
    if registration is None:
        return None
    keys = Keyspace(config.pool_namespace)
    ttl_s = signal_ttl_s(config.signal_interval_s)
    board = SignalBoard(registration.registry.client, keys, ttl_s=ttl_s)
    return SignalPublisher(
        board, engine.stats, config.worker_id, config.role, config.signal_interval_s
    ).start()


async def _wait_idle(engine: LLMEngine, exporter: KvExporter | None, timeout: float) -> None:
    """Let running streams finish and exported KV be pulled, up to `timeout` seconds."""
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        busy = engine.has_unfinished() or (exporter is not None and exporter.stats().leases.active)
        if not busy:
            return
        await asyncio.sleep(0.05)
    log.warning("drain timeout: stopping with requests still running")
