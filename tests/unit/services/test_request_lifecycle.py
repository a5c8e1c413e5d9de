"""One gateway request cancelled at every await point of its life, once and twice (the
second cancel landing while it cleans up), on real Redis (placement, load leases, quota)
in front of fake workers that hold the request at each point. Every test ends with the
leak check: the record holds nothing and is closed, the gauge's counts are 0, the stream
slot is back, no load lease is left in the router, the quota keeps only what was
generated, no prefill worker keeps KV (an Abort was sent where it had to be), and no
decode call is left open. Where the client sits on a message, the stream buffer lets the
relay read on, so the relay is held at its next worker call there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import redis
from prometheus_client import CollectorRegistry

from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2
from services.common.status import QuotaExceeded, StreamCapReached
from services.gateway.stream.errors import StreamError
from services.gateway.stream.record_book import GAUGE, HeldCollector, Resource
from services.gateway.stream.request_record import RequestRecord, RequestState
from tests.unit.services.gateway_fakes import (
    DECODE_TOKENS,
    FIRST_TOKEN,
    MAX_TOKENS,
    PROMPT,
    Client,
    assert_nothing_held,
    build_gateway,
    only_record,
)


async def cancel(task: asyncio.Task[None], record: RequestRecord, times: int) -> None:
    task.cancel()
    if times == 2:
        for _ in range(20):  # a few loop turns: the cancel unwinds a wait_for first
            if record.state is RequestState.CLEANING:
                break
            await asyncio.sleep(0)
        assert record.state is RequestState.CLEANING  # the first cancel reached the cleanup
        assert not task.done()
        task.cancel()  # ...which the second must not cut short


# The await points of one request, in order: (name, message the client stalls after).
POINTS = [
    ("charge", None),  # the quota charge's Redis call (charged, answer not back yet)
    ("route", None),  # the placement's Redis call (leases taken, decision not back yet)
    ("prefill", None),  # the Prefill call (KV exported, answer not back yet)
    ("first_token", 0),  # token 1 handed to the client, which has not taken it
    ("import", None),  # the first decode read (the KV import)
    ("decode_token", 1),  # a decode token handed to the client
    ("next_token", None),  # a later decode read
    ("final_message", 3),  # the last message handed to the client
]
STALLS = dict(POINTS)
# Where the relay is while the client sits on a message: the stream buffer lets it read
# on, so it is held at the next worker call (the last message: it is over).
RELAY_AT = {"first_token": "import", "decode_token": "next_token"}
UNPULLED = {"prefill", "first_token", "import"}  # the prefill worker keeps the KV here


@pytest.mark.parametrize("times", [1, 2], ids=["cancelled", "cancelled_twice"])
@pytest.mark.parametrize("point", [name for name, _ in POINTS])
def test_cancel_at_every_await_point_leaves_nothing_held(
    client: redis.Redis, namespace: str, model_dir: Path, point: str, times: int
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        thread_gate = {"charge": gw.charge_gate, "route": gw.route_gate}.get(point)
        gate = gw.cluster.gates.get(RELAY_AT.get(point, point))
        if thread_gate is not None:
            thread_gate.hold()
        elif gate is not None:
            gate.hold()
        reader = Client(gw, STALLS[point])
        task = asyncio.create_task(reader.run())
        if thread_gate is not None:
            await thread_gate.reached()
        if gate is not None:
            await asyncio.wait_for(gate.arrived.wait(), 10)
        if STALLS[point] is not None:
            await asyncio.wait_for(reader.stalled.wait(), 10)
        if point == "final_message":
            assert only_record(gw).state is RequestState.FINISHED
        record = only_record(gw)
        await cancel(task, record, times)
        if thread_gate is not None:
            thread_gate.proceed.set()  # the Redis call answers after its caller left
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_nothing_held(gw, record)
        rid = record.req.worker_request_id
        # Exactly what was held is given back: an Abort only for KV not yet pulled.
        assert gw.cluster.aborts == ([("p0:1", rid)] if point in UNPULLED else [])
        assert all(c.cancelled or c.ended for c in gw.cluster.decodes)

    asyncio.run(scenario())


def test_a_request_holds_each_resource_only_while_it_needs_it(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """What the record holds at each point, as the gauge shows it; and max_tokens ends
    the stream with LENGTH."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        registry = CollectorRegistry()
        registry.register(HeldCollector(gw.service.book))

        def gauge() -> set[str]:
            return {
                r.value
                for r in Resource
                if registry.get_sample_value(GAUGE, {"resource": r.value}) == 1
            }

        seen: dict[str, set[str]] = {}
        for point in ("prefill", "import", "next_token"):
            gw.cluster.gates[point].hold()
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        for point in ("prefill", "import", "next_token"):
            await asyncio.wait_for(gw.cluster.gates[point].arrived.wait(), 10)
            seen[point] = gauge()
            assert seen[point] == {r.value for r in only_record(gw).held}
            gw.cluster.gates[point].proceed.set()
        await task
        admitted = {"stream_slot", "quota_charge", "load_lease"}
        assert seen["prefill"] == admitted | {"prefill_lease"}
        assert seen["import"] == admitted | {"prefill_lease", "decode_stream"}
        assert seen["next_token"] == admitted | {"decode_stream"}  # the KV was pulled
        assert gauge() == set()
        last = reader.received[-1]
        assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == MAX_TOKENS
        assert gw.cluster.aborts == []

    asyncio.run(scenario())


@pytest.mark.parametrize("times", [1, 2], ids=["cancelled", "cancelled_twice"])
def test_cancel_while_routing_again_after_a_failed_prefill(
    client: redis.Redis, namespace: str, model_dir: Path, times: int
) -> None:
    """The first prefill worker is unreachable; the request is cancelled while the retry
    is being placed: both placements' load leases go back, and the first worker gets an
    Abort in case it kept the KV."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, prefill_workers=2)
        gw.cluster.unreachable_first = True
        gw.route_gate.hold(from_call=2)
        task = asyncio.create_task(Client(gw).run())
        await gw.route_gate.reached()
        record = only_record(gw)
        await cancel(task, record, times)
        gw.route_gate.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_nothing_held(gw, record)
        first = gw.cluster.prefills[0]
        assert gw.cluster.aborts == [(first, record.req.worker_request_id)]

    asyncio.run(scenario())


def test_a_failed_import_aborts_the_prefill_lease(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """The decode worker could not pull the KV and moving is off: the prefill worker
    still holds it, and only the gateway's Abort frees it before its TTL."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, max_migrations=0)
        gw.cluster.import_fails = True
        reader = Client(gw)
        with pytest.raises(StreamError) as failed:
            await reader.run()
        assert failed.value.code == grpc.StatusCode.NOT_FOUND
        assert gw.cluster.aborts == [("p0:1", gw.cluster.decodes[0].request.request_id)]
        assert gw.service.book.live() == []  # the stream's end waited for its cleanup
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert gw.cluster.leaks() == [] and gw.load_counts() == {"prefill": {}, "decode": {}}
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)

    asyncio.run(scenario())


def test_a_lost_kv_is_prefilled_again_by_the_same_decode_worker(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """The import found the lease gone (NOT_FOUND: it expired or was cancelled during the
    read, and the bytes were discarded): the same decode worker prefills the prompt
    itself, resuming after token 1, and the client sees every token once."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=2)
        gw.cluster.import_fails = True
        reader = Client(gw)
        await reader.run()
        lost, again = gw.cluster.decodes
        assert again.address == lost.address and not again.request.HasField("kv_handle")
        assert list(again.request.resume_token_ids) == [FIRST_TOKEN]
        tokens = [t for m in reader.received for t in m.token_ids]
        assert tokens == [FIRST_TOKEN, *DECODE_TOKENS]
        assert reader.received[-1].finished
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert gw.cluster.leaks() == [] and gw.load_counts() == {"prefill": {}, "decode": {}}
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)

    asyncio.run(scenario())


def test_refused_requests_hold_nothing(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """A request refused at the stream cap, and one refused by its quota, give back the
    slot and keep no charge (a refused request's whole charge is refunded), while a
    running request keeps what it holds."""

    async def scenario() -> None:
        tokens = len(Tokenizer(model_dir).encode(PROMPT))
        gw = build_gateway(
            client, namespace, model_dir, max_streams=1, tokens_per_minute=tokens + MAX_TOKENS
        )
        gw.cluster.gates["prefill"].hold()
        running = asyncio.create_task(Client(gw).run())
        await asyncio.wait_for(gw.cluster.gates["prefill"].arrived.wait(), 10)
        with pytest.raises(QuotaExceeded):  # the minute's tokens are charged to `running`
            await Client(gw, max_tokens=MAX_TOKENS).run()
        assert gw.service.active == 1 and len(gw.service.book) == 1
        gw.cluster.gates["prefill"].proceed.set()
        await running
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
        assert gw.quota_used() == tokens + MAX_TOKENS
        assert gw.load_counts() == {"prefill": {}, "decode": {}} and gw.cluster.leaks() == []

    async def at_the_cap() -> None:
        tokens = len(Tokenizer(model_dir).encode(PROMPT))
        gw = build_gateway(
            client, f"{namespace}-cap", model_dir, max_streams=1, tokens_per_minute=10_000
        )
        gw.cluster.gates["prefill"].hold()
        running = asyncio.create_task(Client(gw).run())
        await asyncio.wait_for(gw.cluster.gates["prefill"].arrived.wait(), 10)
        with pytest.raises(StreamCapReached) as busy:
            await Client(gw).run()
        assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert busy.value.retry_after_s >= 1
        await gw.service.stubs.cleanups.close(timeout_s=10.0)  # its refund has landed
        assert gw.quota_used() == tokens + MAX_TOKENS  # only the running one's charge
        gw.cluster.gates["prefill"].proceed.set()
        await running
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
        assert gw.load_counts() == {"prefill": {}, "decode": {}} and gw.cluster.leaks() == []

    asyncio.run(scenario())
    asyncio.run(at_the_cap())
