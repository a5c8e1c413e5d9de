"""A gateway in process, on real Redis (placement, load leases, quota), in front of fake
workers whose every call can be held at a `Gate`: what the gateway request tests drive,
with a `Client` that reads a request's stream as a front door would (and can go quiet),
and the leak check every such test ends with (`assert_nothing_held`).

The fakes model what a worker holds for the gateway: a prefill worker keeps a request's
KV under a lease from the moment it exports it (before its answer is on the wire) until a
decode worker pulls it or an Abort drops it; a decode call is open until it ends or the
gateway cancels it. `FakeCluster.leaks()` names whatever is still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis

from engine.model_identity import ModelIdentity
from engine.model_spec import ModelSpec
from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2
from services.gateway.access.auth import ANONYMOUS, Principal
from services.gateway.access.gate import Access
from services.gateway.access.quota import TokenQuota
from services.gateway.client import RequestOptions, build_request
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission import Admission
from services.gateway.models.backend import SharedParts
from services.gateway.models.catalog import build_catalog
from services.gateway.models.served_model import ServedModelSpec
from services.gateway.service import GatewayService
from services.gateway.stream.buffer import Disconnect
from services.gateway.stream.record_book import Resource
from services.gateway.stream.request_record import RequestRecord, RequestState
from services.gateway.stream.worker_stubs import WorkerStubs
from services.router.identity_check import GATEWAY_PARTS
from services.router.keyspace import Keyspace
from services.router.redis_placement import RedisPlacement
from services.router.registry import Registry, WorkerInfo
from services.router.router import Router
from services.router.router_config import RouterConfig

DECODE_TOKENS = (11, 12, 13)  # what the fake decode worker streams, one chunk each
FIRST_TOKEN = 10
PROMPT = "Tell me about the sea."
MAX_TOKENS = 1 + len(DECODE_TOKENS)  # token 1 from prefill, the rest from decode


class Gate:
    """One await point a test can hold a request at (open unless held)."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.proceed = asyncio.Event()
        self.proceed.set()

    def hold(self) -> None:
        self.proceed.clear()

    async def passing(self) -> None:
        self.arrived.set()
        await self.proceed.wait()


class ThreadGate:
    """A gate inside a thread (a Redis round trip the event loop waits for): the work
    is done, its answer is held back."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.proceed = threading.Event()
        self.proceed.set()
        self.calls = 0
        self._from_call = 0

    def hold(self, from_call: int = 1) -> None:
        """Hold the `from_call`-th call and every later one."""
        self._from_call = from_call
        self.proceed.clear()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def gated(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            self.calls += 1
            if self.calls >= self._from_call:
                self.arrived.set()
                self.proceed.wait(timeout=30)
            return result

        return gated

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.arrived.wait, 10), "the thread never got there"


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeDecodeCall:
    """A Decode stream: the first read is the KV import (it pulls the prefill lease),
    unless the worker refuses it (`FakeCluster.decode_refusals`)."""

    def __init__(
        self, cluster: FakeCluster, request: worker_pb2.DecodeRequest, address: str = ""
    ) -> None:
        self.cluster = cluster
        self.request = request
        self.address = address
        self.refusal = cluster.decode_refusals.pop(0) if cluster.decode_refusals else None
        self.dies_at = cluster.decode_deaths.pop(0) if cluster.decode_deaths else None
        self.index = len(cluster.decodes)  # this call's place among the cluster's Decodes
        # A moved stream resumes after token 1 and the decode tokens it already sent.
        self.offset = max(0, len(request.resume_token_ids) - 1)
        self.reads = 0
        self.cancelled = False
        self.ended = False

    async def read(self) -> worker_pb2.DecodeChunk | Any:
        n, self.reads = self.reads, self.reads + 1
        if n == self.dies_at:
            self.ended = True
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        n += self.offset
        gates = self.cluster.gates
        await (
            gates["import"] if n == 0 else gates["next_token"] if n == 1 else gates["late"]
        ).passing()
        if n == 1 and self.cluster.torn_down:
            raise asyncio.CancelledError  # as a grpc.aio call closed under its reader
        if n == self.offset:  # the call's first read: the import, or the refusal
            if self.refusal is not None:  # nothing pulled: the KV stays on prefill
                self.ended = True
                raise rpc_error(self.refusal, "no room for the KV")
            imports = self.request.HasField("kv_handle")
            if imports and (self.cluster.import_fails or self.index in self.cluster.lost_imports):
                self.ended = True
                raise rpc_error(grpc.StatusCode.NOT_FOUND, "lease expired")
            if imports:
                self.cluster.leases.discard(self.request.request_id)  # pulled
        if n >= len(DECODE_TOKENS):
            self.ended = True
            return grpc.aio.EOF
        last = n == len(DECODE_TOKENS) - 1
        self.ended = last
        return worker_pb2.DecodeChunk(
            token_ids=[DECODE_TOKENS[n]],
            finished=last,
            finish_reason=self.cluster.finish_reason if last else 0,
        )

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeWorker:
    """The Worker stub of one address; its state lives in the cluster."""

    def __init__(self, cluster: FakeCluster, address: str) -> None:
        self.cluster = cluster
        self.address = address

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, timeout: float | None = None, **_: object
    ) -> worker_pb2.PrefillResponse:
        cluster = self.cluster
        cluster.prefills.append(self.address)
        cluster.priorities.append(("prefill", request.priority))
        cluster.adapters.append(("prefill", request.adapter))
        if (cluster.unreachable_first and len(cluster.prefills) == 1) or len(
            cluster.prefills
        ) in cluster.unreachable_prefills:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if len(cluster.prefills) in cluster.busy_prefills:
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "all 8 adapter slots held")
        if self.address in cluster.broken:
            raise rpc_error(grpc.StatusCode.INTERNAL, "the model raised")
        finished = request.sampling.max_tokens == 1
        if not finished:
            cluster.leases.add(request.request_id)  # exported: held until pulled or aborted
        try:  # the call's deadline, as gRPC would enforce it
            await asyncio.wait_for(cluster.gates["prefill"].passing(), timeout)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        response = worker_pb2.PrefillResponse(
            first_token_id=FIRST_TOKEN, worker_id=self.address, finished=finished
        )
        if finished:
            response.finish_reason = cluster.finish_reason
        else:
            response.kv_handle.CopyFrom(common_pb2.KvHandle(lease_id=request.request_id))
        return response

    def Decode(self, request: worker_pb2.DecodeRequest, **_: object) -> FakeDecodeCall:
        self.cluster.priorities.append(("decode", request.priority))
        self.cluster.adapters.append(("decode", request.adapter))
        call = FakeDecodeCall(self.cluster, request, self.address)
        self.cluster.decodes.append(call)
        return call

    async def Abort(
        self, request: worker_pb2.AbortRequest, **_: object
    ) -> worker_pb2.AbortResponse:
        self.cluster.aborts.append((self.address, request.request_id))
        await self.cluster.gates["abort"].passing()
        found = request.request_id in self.cluster.leases
        self.cluster.leases.discard(request.request_id)
        return worker_pb2.AbortResponse(found=found)


@dataclass
class FakeCluster:
    gates: dict[str, Gate] = field(default_factory=dict)
    leases: set[str] = field(default_factory=set)  # request ids with KV on a prefill worker
    prefills: list[str] = field(default_factory=list)  # addresses, in call order
    decodes: list[FakeDecodeCall] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)  # (address, request id)
    priorities: list[tuple[str, int]] = field(default_factory=list)  # (call, proto class)
    adapters: list[tuple[str, common_pb2.Adapter]] = field(default_factory=list)  # (call, its)
    unreachable_first: bool = False  # the first Prefill call fails: UNAVAILABLE
    import_fails: bool = False
    lost_imports: set[int] = field(default_factory=set)  # Decode calls (0-based): NOT_FOUND
    unreachable_prefills: set[int] = field(default_factory=set)  # Prefill calls (1-based)
    busy_prefills: set[int] = field(default_factory=set)  # Prefill calls: RESOURCE_EXHAUSTED
    broken: set[str] = field(default_factory=set)  # addresses whose Prefill fails: INTERNAL
    decode_refusals: list[grpc.StatusCode] = field(default_factory=list)  # next calls', in order
    decode_deaths: list[int | None] = field(default_factory=list)  # next calls': dies at read
    torn_down: bool = False  # the decode call's second read is cancelled from outside
    finish_reason: int = common_pb2.FINISH_REASON_LENGTH  # the decode's last chunk

    def __post_init__(self) -> None:
        for name in ("prefill", "import", "next_token", "late", "abort"):
            self.gates.setdefault(name, Gate())

    def leaks(self) -> list[str]:
        held = [f"prefill lease {rid}" for rid in sorted(self.leases)]
        held += [
            f"decode call {c.request.request_id}"
            for c in self.decodes
            if not (c.cancelled or c.ended)
        ]
        return held


class FakeStubs(WorkerStubs):
    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__()
        self.cluster = cluster

    def __getitem__(self, address: str) -> Any:
        return FakeWorker(self.cluster, address)


@dataclass
class Gateway:
    """A GatewayService on real Redis, and the gates on its Redis round trips."""

    service: GatewayService
    cluster: FakeCluster
    client: redis.Redis
    namespace: str
    charge_gate: ThreadGate
    route_gate: ThreadGate

    @property
    def router(self) -> Router:
        placement = self.service.models.primary.placement
        assert isinstance(placement, RedisPlacement)
        return placement.router

    def load_counts(self) -> dict[str, dict[str, int]]:
        ledger = self.router.ledger
        return {role: ledger.snapshot(role).counts for role in ("prefill", "decode")}

    def quota_used(self) -> int:
        """Tokens charged to the tenant's windows, after refunds."""
        keys = self.client.keys(f"{self.namespace}:quota:*")
        return sum(int(self.client.get(k) or 0) for k in keys)


def build_gateway(
    client: redis.Redis,
    namespace: str,
    model_dir: Path,
    *,
    prefill_workers: int = 1,
    decode_workers: int = 1,
    tokens_per_minute: int = 100_000,
    worker_identity: ModelIdentity | None = None,
    **config: Any,
) -> Gateway:
    """`worker_identity`: the model identity the fake workers publish (None: none)."""
    registry = Registry(client, Keyspace(namespace))
    for role, n in (("prefill", prefill_workers), ("decode", decode_workers)):
        for i in range(n):
            wid = f"{role[0]}{i}"
            info = WorkerInfo(wid, role, "m", "l", f"{wid}:1", identity=worker_identity)  # type: ignore[arg-type]
            registry.register(info)
    spec = ModelSpec.from_dir(model_dir)
    router = Router(client, RouterConfig(namespace=namespace))
    assert spec.identity is not None
    router.expect_identity(spec.identity, GATEWAY_PARTS, "this gateway")  # as build_service
    router.refresh()
    route_gate, charge_gate = ThreadGate(), ThreadGate()
    router.route = route_gate.wrap(router.route)  # type: ignore[method-assign]
    quota = TokenQuota(client, namespace)
    quota.admit = charge_gate.wrap(quota.admit)  # type: ignore[method-assign]
    cluster = FakeCluster()
    config.setdefault("local_prefill_max_tokens", 0)  # the prefill hop, unless asked
    cfg = GatewayConfig(placement="redis", **config)
    parts = SharedParts(Access(None, quota, tokens_per_minute), FakeStubs(cluster))
    model = ServedModelSpec(
        "m", Tokenizer(model_dir), spec.max_position_embeddings, spec.vocab_size,
        RedisPlacement(router), Admission(cfg),
    )  # fmt: skip
    service = GatewayService(cfg, build_catalog([model], parts), parts)
    return Gateway(service, cluster, client, namespace, charge_gate, route_gate)


# -- driving one request through the service, and the leak check ------------------------
def request(max_tokens: int = MAX_TOKENS) -> gateway_pb2.GenerateRequest:
    return build_request(PROMPT, RequestOptions(max_tokens=max_tokens, request_id="r"))


def prompt_tokens(gw: Gateway) -> int:
    return len(gw.service.models.primary.tokenizer.encode(PROMPT))


def only_record(gw: Gateway) -> RequestRecord:
    (record,) = gw.service.book.live()
    return record


async def assert_nothing_held(gw: Gateway, record: RequestRecord) -> None:
    """The leak check: wait for cleanups to end, then every resource is back."""
    await gw.service.stubs.cleanups.close(timeout_s=10.0)
    assert record.state is RequestState.CLOSED
    assert record.held == frozenset()
    assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
    assert len(gw.service.book) == 0 and gw.service.active == 0
    assert gw.load_counts() == {"prefill": {}, "decode": {}}
    # A request that never reached routing used nothing: its prompt is refunded too.
    billed_prompt = prompt_tokens(gw) if record.served else 0
    assert gw.quota_used() == billed_prompt + record.completion_tokens
    assert gw.cluster.leaks() == []


class Client:
    """Reads the stream like a front door; `stall_at` stops reading (without closing)
    after that message, as a client that went quiet would, until `resume` is set."""

    def __init__(
        self,
        gw: Gateway,
        stall_at: int | None = None,
        max_tokens: int = MAX_TOKENS,
        *,
        principal: Principal = ANONYMOUS,
        priority: int = common_pb2.PRIORITY_UNSPECIFIED,
        disconnect: Disconnect | None = None,
    ) -> None:
        self.gw = gw
        self.stall_at = stall_at
        self.max_tokens = max_tokens
        self.principal = principal
        self.priority = priority
        self.disconnect = disconnect
        self.received: list[gateway_pb2.GenerateResponse] = []
        self.stalled = asyncio.Event()
        self.resume = asyncio.Event()

    async def run(self) -> None:
        req = request(self.max_tokens)
        req.priority = self.priority
        stream = self.gw.service.stream(
            self.gw.service.decode(req), self.principal, self.disconnect
        )
        async with contextlib.aclosing(stream) as messages:
            async for msg in messages:
                self.received.append(msg)
                if len(self.received) - 1 == self.stall_at:
                    self.stalled.set()
                    await self.resume.wait()


async def until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), timeout)


async def start_request(gw: Gateway) -> tuple[Client, asyncio.Task[None], RequestRecord]:
    """One request started through the gateway: its reader, the reading task, and its
    record once it is live."""
    reader = Client(gw)
    task = asyncio.create_task(reader.run())
    await until(lambda: len(gw.service.book.live()) == 1)
    return reader, task, only_record(gw)
