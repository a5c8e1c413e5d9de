"""Sending one flow-control phase: many tenants, each with its own API key and class,
through one or more gateways, timing every stream and every refusal.

Lifecycle: `run_flow(addresses, keys, requests, pace)` opens one `GatewayClient` per
(gateway, tenant) pair in use (the key is the client's `authorization` metadata; the
class is the request's `priority` field), sends each request at its `at_s` (open loop: a
slow answer never delays the next send), stops sending once `pace.duration_s` has passed,
waits for everything in flight (each stream has the client deadline
`pace.request_timeout_s`) and returns one `FlowRecord` per request sent, in send order. A
refusal is recorded with its status, reason and the time it took
(`loadtest.flow.refusal`). Cancelling the run cancels every open stream, which the
gateway propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from loadtest.flow.record import FlowRecord
from loadtest.flow.refusal import metadata_dict, refusal_of
from loadtest.flow.traffic import FlowRequest
from services.common.request_codec import priority_to_proto
from services.gateway.client import GatewayClient


@dataclass(frozen=True)
class FlowPace:
    duration_s: float  # no send after this
    request_timeout_s: float = 60.0  # client deadline of one stream
    ignore_eos: bool = True  # every served request generates exactly its max_tokens

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("duration_s and request_timeout_s must be > 0")


class _Phase:
    """The clock, the clients and the records of one phase."""

    def __init__(self, clients: Mapping[tuple[int, str], GatewayClient], pace: FlowPace) -> None:
        self.clients = clients
        self.pace = pace
        self.t0 = time.perf_counter()
        self.tag = f"flow{int(time.time() * 1000) % 10**9}"  # unique ids across runs
        self.records: list[FlowRecord] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, req: FlowRequest) -> None:
        rec = FlowRecord(req.spec.request_id, req.tenant, req.priority, req.gateway, self.now())
        self.records.append(rec)
        proto = req.spec.to_proto(ignore_eos=self.pace.ignore_eos, run_tag=self.tag)
        proto.priority = priority_to_proto(req.priority)
        call = self.clients[(req.gateway, req.tenant)].generate(
            proto, timeout=self.pace.request_timeout_s
        )
        try:
            async for msg in call:
                rec.took(self.now(), len(msg.token_ids))
                if msg.finished:
                    rec.prompt_tokens = msg.usage.prompt_tokens
                    rec.output_tokens = msg.usage.completion_tokens
        except grpc.aio.AioRpcError as exc:
            rec.code, rec.details = exc.code().name, exc.details() or ""
            trailing = metadata_dict(exc.trailing_metadata())
            rec.refusal = refusal_of(rec.code, rec.details, trailing, rec.first_token_s is not None)
        except asyncio.CancelledError:  # the benchmark itself is stopping
            rec.code = grpc.StatusCode.CANCELLED.name
            call.cancel()
            raise
        finally:
            rec.finished_s = self.now()


async def _open_loop(phase: _Phase, requests: Sequence[FlowRequest]) -> None:
    tasks: list[asyncio.Task[None]] = []
    try:
        for req in requests:
            if req.at_s >= phase.pace.duration_s:
                break
            delay = req.at_s - phase.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(phase.send(req)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def run_flow(
    addresses: Sequence[str],
    keys: Mapping[str, str],
    requests: Sequence[FlowRequest],
    pace: FlowPace,
) -> list[FlowRecord]:
    """Send one phase; `keys` maps each tenant to its API key (a tenant without one
    sends none). Returns the records of the requests sent, in send order."""
    pairs = sorted({(r.gateway, r.tenant) for r in requests})
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for gateway, tenant in pairs:
            client = GatewayClient(addresses[gateway], api_key=keys.get(tenant, ""))
            clients[(gateway, tenant)] = await stack.enter_async_context(client)
        phase = _Phase(clients, pace)
        await _open_loop(phase, requests)
    return phase.records
