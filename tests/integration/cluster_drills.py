"""Tools for fault drills on a `LocalCluster`: find, kill, freeze and restart its
processes, watch its registry, and hold streams open while a fault hits them.

Nothing here decides what a test expects; `test_faults.py` states the bounds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc
from services.cluster.local_cluster import Child, LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry
from tests.integration.test_cluster import _collect


def named(cluster: LocalCluster, name: str) -> Child:
    return next(c for c in cluster.children if c.name == name)


def pool(cluster: LocalCluster, role: str) -> list[Child]:
    return [c for c in cluster.children if c.name.startswith(f"{role}-")]


def kill(process: Child) -> float:
    """SIGKILL and reap; returns when it died (monotonic)."""
    os.kill(process.proc.pid, signal.SIGKILL)
    process.proc.wait(timeout=10)
    return time.monotonic()


def registered(cluster: LocalCluster) -> set[str]:
    return set(home_roles(cluster))


def home_roles(cluster: LocalCluster) -> dict[str, str]:
    """Worker id -> the role it is registered under now."""
    assert cluster.redis is not None
    client = connect(cluster.redis.url, 2.0)
    try:
        return {w.worker_id: w.role.value for w in Registry(client, Keyspace()).list()}
    finally:
        client.close()


@dataclass
class Stream:
    """A live Generate stream and what it has delivered so far."""

    call: grpc.aio.UnaryStreamCall
    msgs: list[gateway_pb2.GenerateResponse] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each message

    @classmethod
    async def open(
        cls,
        client: GatewayClient,
        prompt: str,
        max_tokens: int,
        first: int = 2,
        seed: int | None = None,
    ) -> Stream:
        """A stream once its first `first` messages came; greedy unless `seed` is given
        (then sampled at temperature 0.8 with that seed)."""
        temperature = None if seed is None else 0.8
        request = build_request(
            prompt,
            RequestOptions(
                max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=seed
            ),
        )
        stream = cls(client.generate(request))
        while len(stream.msgs) < first:
            stream._take(await stream.call.read())
        return stream

    def _take(self, msg: gateway_pb2.GenerateResponse) -> None:
        self.msgs.append(msg)
        self.times.append(time.monotonic())

    @property
    def decode_worker(self) -> str:
        return next(m.decode_worker for m in self.msgs if m.decode_worker)

    @property
    def decode_workers(self) -> list[str]:
        """Every decode worker that sent this stream tokens, in order (a move adds one)."""
        seen: list[str] = []
        for m in self.msgs:
            if m.decode_worker and m.decode_worker not in seen:
                seen.append(m.decode_worker)
        return seen

    @property
    def tokens(self) -> list[int]:
        return [t for m in self.msgs for t in m.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.text for m in self.msgs)

    def longest_gap_after(self, since: float) -> float:
        """The longest wait between two messages that ended after `since` (monotonic)."""
        pairs = zip(self.times, self.times[1:], strict=False)
        gaps = [b - max(a, since) for a, b in pairs if b > since]
        return max(gaps, default=0.0)

    async def finish(self) -> tuple[grpc.StatusCode, float]:
        """Read to the end: (OK or the error status, monotonic time it ended)."""
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                self._take(msg)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), time.monotonic()
        assert self.msgs[-1].finished
        return grpc.StatusCode.OK, time.monotonic()


async def serve(cluster: LocalCluster, n: int, tag: str) -> set[tuple[str, str]]:
    """n short requests, each must finish; the (prefill, decode) worker pairs that served."""
    pairs = set()
    for i in range(n):
        got = await _collect(
            cluster.gateway_address,
            prompt=f"Fault drill {tag}-{i}: name one fact about the sea.",
            max_tokens=3,
            ignore_eos=True,
        )
        msgs = cast(list[gateway_pb2.GenerateResponse], got)
        assert msgs[-1].finished
        decode = next(m.decode_worker for m in msgs if m.decode_worker)
        pairs.add((msgs[0].prefill_worker, decode))
    return pairs


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def busy_prefill(
    cluster: LocalCluster, request: asyncio.Future[Any], timeout: float = 30.0
) -> Child:
    """The prefill worker computing `request`'s prompt right now: the one burning CPU.
    (Not through Stats: it waits for the engine lock, which a prefill holds step after
    step, so it answers only once the prompt is done.)"""
    live = [c for c in pool(cluster, "prefill") if c.proc.poll() is None]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if request.done():
            raise AssertionError(f"the request ended before a worker was caught: {request}")
        before = [cpu_ticks(c.proc.pid) for c in live]
        await asyncio.sleep(0.3)
        used = [cpu_ticks(c.proc.pid) - b for c, b in zip(live, before, strict=True)]
        busiest = max(range(len(live)), key=lambda i: used[i])
        rest = max((u for i, u in enumerate(used) if i != busiest), default=0)
        if used[busiest] >= 8 and used[busiest] >= 3 * rest:  # >= 80 ms of CPU in 300 ms
            return live[busiest]
    raise TimeoutError("no prefill worker picked the long prompt up")


async def kv_transfer_port(address: str) -> int:
    """The worker's KvTransfer port, read off a handle from a direct Prefill call."""
    rid = uuid.uuid4().hex
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        reply = await stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=list(range(100, 140)),
                sampling=common_pb2.SamplingParams(max_tokens=4),
            ), timeout=60,
        )  # fmt: skip
        await stub.Abort(worker_pb2.AbortRequest(request_id=rid))
    return int(reply.kv_handle.transfer_address.rsplit(":", 1)[1])


def restart_on_same_ports(cluster: LocalCluster, name: str, kv_port: int) -> None:
    grpc_port = named(cluster, name).address.rsplit(":", 1)[1]
    cluster.relaunch(name, "--port", grpc_port, "--kv-transfer-port", str(kv_port))


async def reachable(cluster: LocalCluster) -> set[str]:
    """Workers the gateway itself reaches now (ClusterStatus asks each over its channel)."""
    async with GatewayClient(cluster.gateway_address) as client:
        status = await client.cluster_status()
    return {w.worker_id for w in status.workers if not w.role.startswith("unreachable")}
