"""`HomeRole` on a real Redis: a change starts the new role's phase before the registry
moves the worker, a failed change keeps the role, and the planner's tick moves a worker
only after a window of readings and only once per window in the cluster. (`Phases` is
replaced by a recorder here: starting NIXL agents belongs to the integration tests.)"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis

from engine.stats import ClassCounts
from services.common.role import Role
from services.engine_host.telemetry import WorkerTelemetry
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.registry import IncompatibleWorkerError, Registry, WorkerInfo
from services.router.worker_signal import MIN_DECODE_STREAMS, SignalBoard, WorkerSignal
from services.worker.home_role import ChangeReason, HomeRole
from services.worker.registration import WorkerRegistration
from services.worker.role_planner import RolePlanner
from tests.unit.services.test_capacity import signal

WINDOW_S = 5.0


class _Phases:
    """Records each `serve` with the role the registry held for the worker at that time."""

    def __init__(self, registry: Registry, worker_id: str) -> None:
        self.registry = registry
        self.worker_id = worker_id
        self.served: list[tuple[Role, Role]] = []
        self.prefill_calls = 0

    def serve(self, role: Role) -> None:
        (me,) = [w for w in self.registry.list() if w.worker_id == self.worker_id]
        self.served.append((role, me.role))


def _info(worker_id: str, role: Role) -> WorkerInfo:
    return WorkerInfo(worker_id, role, "model", "layout", f"addr-{worker_id}", incarnation="i1")


async def _home(url: str, namespace: str, worker_id: str, role: Role) -> tuple[HomeRole, _Phases]:
    registration = WorkerRegistration(url, namespace, 30.0, _info(worker_id, role))
    await registration.start()
    phases = _Phases(registration.registry, worker_id)
    home = HomeRole(role, phases, WorkerTelemetry.disabled(worker_id))  # type: ignore[arg-type]
    home.attach(registration, None, RolePlanner(worker_id, WINDOW_S, 512))
    return home, phases


def _roles(client: redis.Redis, namespace: str) -> dict[str, Role]:
    return {w.worker_id: w.role for w in Registry(client, Keyspace(namespace)).list()}


def test_a_change_serves_the_new_phase_first_then_moves_the_registration(
    redis_server: EmbeddedRedis, client: redis.Redis, namespace: str
) -> None:
    async def scenario() -> None:
        home, phases = await _home(redis_server.url, namespace, "p0", Role.PREFILL)
        try:
            assert await home.change(Role.DECODE, ChangeReason.OPERATOR) is Role.PREFILL
            assert phases.served == [(Role.DECODE, Role.PREFILL)]  # able before it is found
            assert _roles(client, namespace) == {"p0": Role.DECODE}
            assert await home.change(Role.DECODE, ChangeReason.OPERATOR) is Role.DECODE
            assert len(phases.served) == 1  # the same role: nothing to do
            assert home.registration is not None
            await asyncio.sleep(0)  # a heartbeat now carries the new role
            assert home.registration.current().role is Role.DECODE
        finally:
            assert home.registration is not None
            await home.registration.stop()

    asyncio.run(scenario())


def test_a_change_redis_refuses_keeps_the_role(
    redis_server: EmbeddedRedis, client: redis.Redis, namespace: str
) -> None:
    async def scenario() -> None:
        home, _ = await _home(redis_server.url, namespace, "d0", Role.DECODE)
        assert home.registration is not None
        try:
            # Another process took the id as a mixed worker: the move is refused.
            Registry(client, Keyspace(namespace)).deregister("d0")
            clash = replace(_info("d0", Role.MIXED), incarnation="other")
            Registry(client, Keyspace(namespace)).register(clash)
            with pytest.raises(
                IncompatibleWorkerError, match="already registered as a mixed worker"
            ):
                await home.change(Role.PREFILL, ChangeReason.OPERATOR)
            assert home.role is Role.DECODE and home.registration.info.role is Role.DECODE
        finally:
            await home.registration.stop()

    asyncio.run(scenario())


def _publish(board: SignalBoard, *signals: WorkerSignal) -> None:
    for s in signals:
        board.publish(s)


def test_the_planner_moves_one_worker_per_window_after_a_window_of_readings(
    redis_server: EmbeddedRedis, client: redis.Redis, namespace: str
) -> None:
    """Two idle prefill workers beside a loaded decode worker: after a window of
    readings the first to tick becomes decode; the other one, which wants the same,
    must wait for the next window (the cluster's one change per window)."""
    board = SignalBoard(client, Keyspace(namespace), ttl_s=60.0)
    decode = replace(signal(Role.DECODE, wid="d0", rate=1000.0), running=MIN_DECODE_STREAMS)
    idle = [signal(Role.PREFILL, wid=w, rate=1000.0, waiting=ClassCounts()) for w in ("p0", "p1")]

    async def scenario() -> None:
        Registry(client, Keyspace(namespace)).register(_info("d0", Role.DECODE))
        (p0, _), (p1, _) = [
            await _home(redis_server.url, namespace, w, Role.PREFILL) for w in ("p0", "p1")
        ]
        now = [0.0]
        for home in (p0, p1):
            home.clock = lambda: now[0]
        try:
            _publish(board, decode, *idle)
            for t in range(int(WINDOW_S)):
                now[0] = float(t)
                await p0._tick(board)
                await p1._tick(board)
            assert _roles(client, namespace) == {"d0": "decode", "p0": "prefill", "p1": "prefill"}
            now[0] = WINDOW_S
            await p0._tick(board)
            await p1._tick(board)
            assert (p0.role, p1.role) == (Role.DECODE, Role.PREFILL)
            assert _roles(client, namespace)["p0"] is Role.DECODE
        finally:
            for home in (p0, p1):
                assert home.registration is not None
                await home.registration.stop()

    asyncio.run(scenario())


def test_starting_the_planner_unwired_names_what_is_missing() -> None:
    home = HomeRole(Role.PREFILL, None, WorkerTelemetry.disabled("w0"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="needs its planner, registration, publisher"):
        home.start()
