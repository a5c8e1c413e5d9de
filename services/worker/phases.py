"""The request phases one worker can run, grown to fit every home role it has had.

Lifecycle: `Phases(...)` starts with Decode (every role decodes: a prefill worker runs
short requests whole when the gateway's elastic roles send them); `serve(role)` adds what
that role needs on top: the KV exporter and the Prefill handler for a prefill worker, the
KV importer for a decode worker (a mixed worker needs neither). The worker calls it at
start and again before each run-time home-role change registers (`home_role.py`), so a
router that reads the new role finds the worker able to serve it. Nothing is taken away
on a change: a call placed under the old role (a router's membership view is up to one
refresh old; a decode retry; exported KV still to be pulled) is still served. `close()`
stops the transfer agents at exit.
"""

from __future__ import annotations

from kvtransfer.channel import ChannelSecurity
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import KvImporter
from services.common.role import Role
from services.decode.handler import DecodeHandler
from services.engine_host.loop import EngineLoop
from services.engine_host.telemetry import WorkerTelemetry
from services.prefill.handler import PrefillHandler


class Phases:
    """The worker's handlers and transfer agents (read them, never replace them)."""

    def __init__(
        self,
        loop: EngineLoop,
        transfer: TransferConfig,
        worker_id: str,
        security: ChannelSecurity,
        telemetry: WorkerTelemetry,
    ) -> None:
        self.loop = loop
        self.transfer = transfer
        self.worker_id = worker_id
        self.security = security
        self.telemetry = telemetry
        self.decode = DecodeHandler(loop, None, telemetry)
        self.prefill: PrefillHandler | None = None
        self.exporter: KvExporter | None = None
        self.importer: KvImporter | None = None
        self.prefill_calls = 0  # Prefill RPCs served (the role planner reads it)

    def serve(self, role: Role) -> None:
        """Be able to run what `role` runs (idempotent; starts a transfer agent the first
        time a role needs it, which may take a moment)."""
        handoff = self.loop.engine.handoff
        if role is Role.PREFILL and self.exporter is None:
            self.exporter = KvExporter(
                handoff, self.transfer, engine_id=self.worker_id, security=self.security
            ).start()
            self.prefill = PrefillHandler(self.loop, self.exporter, self.worker_id, self.telemetry)
        if role is Role.DECODE and self.importer is None:
            self.importer = KvImporter(
                handoff, self.transfer, engine_id=self.worker_id, security=self.security
            )
            self.decode.importer = self.importer

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self.importer is not None:
            self.importer.close()
