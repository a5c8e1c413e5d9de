"""ServiceHost runs a real gRPC service (the router's health-checked server) on its own
thread: it learns the address from the ready announcement and stops it without signals."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.common.grpc_server import (
    announce_ready,
    build_server,
    wait_for_shutdown_signal,
    wait_healthy,
)
from services.ray.config import RayConfig, parse_resources
from services.ray.service_host import ServiceHost


async def _serve(events: list[str]) -> None:
    built = build_server("127.0.0.1", 0, [])
    await built.server.start()
    await built.mark_serving()
    announce_ready(ready=f"127.0.0.1:{built.port}", role="test")
    await wait_for_shutdown_signal()  # off the main thread: waits on the host's control
    events.append("draining")
    await built.mark_not_serving()
    await built.server.stop(grace=0.5)


def test_host_reports_the_address_and_stops_the_service() -> None:
    events: list[str] = []
    host = ServiceHost("probe", lambda: _serve(events)).start()
    fields = host.wait_ready(10)
    assert fields["role"] == "test"
    assert asyncio.run(wait_healthy(fields["ready"], 5))
    assert host.stop(10)
    assert events == ["draining"] and host.done.is_set() and not host.crashed
    assert not [t for t in threading.enumerate() if t.name == "pdserve-probe"]


def test_a_service_that_fails_before_ready_reports_its_error() -> None:
    async def broken() -> None:
        raise OSError("cannot bind 127.0.0.1:1")

    host = ServiceHost("broken", broken).start()
    with pytest.raises(OSError, match="cannot bind"):
        host.wait_ready(10)
    host.done.wait(5)
    assert host.crashed and isinstance(host.error, OSError)


def test_a_service_that_returns_on_its_own_counts_as_crashed() -> None:
    async def quits() -> None:
        announce_ready(ready="127.0.0.1:1")

    host = ServiceHost("quits", quits).start()
    assert host.wait_ready(10)["ready"] == "127.0.0.1:1"
    assert host.done.wait(5) and host.crashed


def test_stop_before_the_service_waits_returns_at_once() -> None:
    async def late() -> None:
        await asyncio.sleep(0.2)
        await wait_for_shutdown_signal()

    host = ServiceHost("late", late).start()
    assert host.stop(10) and not host.crashed


def test_ray_config_validation_names_the_field() -> None:
    assert parse_resources("gpu_node=1, nvlink_domain=0.5") == {"gpu_node": 1.0,
                                                                 "nvlink_domain": 0.5}  # fmt: skip
    with pytest.raises(ValueError, match="decode_resources"):
        RayConfig(decode_resources="gpu_node")
    with pytest.raises(ValueError, match="max_restarts"):
        RayConfig(max_restarts=-2)
    with pytest.raises(ValueError, match="decode_gpus"):
        RayConfig(decode_gpus=-1)
