"""The gateway's guardrails on one request, on real Redis in front of fake workers: the
priority class a request runs in (the key's default, or what it asks for up to the key's
highest), the operator's `max_tokens` ceiling, the total deadline, and the bounded stream
buffer that gives up on a client that stopped reading. Every request that got as far as
a record ends with the leak check (`assert_nothing_held`: nothing in the record book,
leases released, KV aborted or pulled, quota refunded to what was generated); a request
refused before one holds nothing at all."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import redis

from engine.errors import InvalidRequestError
from engine.priority import Priority
from pdserve.v1 import common_pb2
from services.common.status import PermissionDeniedError, StatusError, code_for
from services.gateway.access.auth import Principal
from services.gateway.service import GrpcDisconnect
from services.gateway.stream.errors import StreamError
from services.gateway.stream.record_book import Resource
from services.gateway.stream.request_record import RequestRecord, RequestState
from tests.unit.services.gateway_fakes import (
    MAX_TOKENS,
    Client,
    Gateway,
    assert_nothing_held,
    build_gateway,
    only_record,
    request,
)

# Run alone (`make test`'s serial phase): a deadline measured to 50 ms.
pytestmark = pytest.mark.serial

P = common_pb2


async def assert_refused_holding_nothing(gw: Gateway) -> None:
    """A request refused before its record: nothing was taken, charged or called."""
    await gw.service.stubs.cleanups.close(timeout_s=10.0)
    assert len(gw.service.book) == 0 and gw.service.book.counts() == dict.fromkeys(Resource, 0)
    assert gw.quota_used() == 0 and gw.load_counts() == {"prefill": {}, "decode": {}}
    assert gw.cluster.prefills == [] and gw.cluster.decodes == []


async def run_to_the_end(gw: Gateway, reader: Client) -> RequestRecord:
    """Run `reader`'s request to its end; returns its record (taken while the relay is
    held at its last decode read)."""
    gate = gw.cluster.gates["late"]
    gate.hold()
    task = asyncio.create_task(reader.run())
    await asyncio.wait_for(gate.arrived.wait(), 10)
    record = only_record(gw)
    gate.proceed.set()
    await task
    return record


class Disconnects:
    """A front door's `disconnect`: records the error it was asked to end the call with."""

    def __init__(self) -> None:
        self.errors: list[StatusError] = []
        self.called = asyncio.Event()

    async def __call__(self, error: StatusError) -> None:
        self.errors.append(error)
        self.called.set()


# -- priority classes ----------------------------------------------------------------
STANDARD_KEY = Principal("acme")
BATCH_KEY = Principal("batch", default_class=Priority.SHEDDABLE)
PAYING_KEY = Principal("paying", max_class=Priority.CRITICAL)


@pytest.mark.parametrize(
    ("principal", "asked", "runs_at"),
    [
        (STANDARD_KEY, P.PRIORITY_UNSPECIFIED, P.PRIORITY_STANDARD),  # the key's default
        (BATCH_KEY, P.PRIORITY_UNSPECIFIED, P.PRIORITY_SHEDDABLE),
        (BATCH_KEY, P.PRIORITY_STANDARD, P.PRIORITY_STANDARD),  # up to its highest
        (STANDARD_KEY, P.PRIORITY_SHEDDABLE, P.PRIORITY_SHEDDABLE),  # lower is always fine
        (PAYING_KEY, P.PRIORITY_CRITICAL, P.PRIORITY_CRITICAL),
    ],
    ids=["default", "key_default", "ask_up", "ask_down", "ask_highest"],
)
def test_the_class_reaches_both_workers(
    client: redis.Redis,
    namespace: str,
    model_dir: Path,
    principal: Principal,
    asked: int,
    runs_at: int,
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        reader = Client(gw, principal=principal, priority=asked)
        record = await run_to_the_end(gw, reader)
        assert reader.received[-1].finished
        assert gw.cluster.priorities == [("prefill", runs_at), ("decode", runs_at)]
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("principal", "asked", "code", "message"),
    [
        (STANDARD_KEY, P.PRIORITY_CRITICAL, grpc.StatusCode.PERMISSION_DENIED,
         "priority: tenant 'acme' may ask for at most standard, not critical"),
        (BATCH_KEY, P.PRIORITY_CRITICAL, grpc.StatusCode.PERMISSION_DENIED,
         "may ask for at most standard"),
        (PAYING_KEY, 7, grpc.StatusCode.INVALID_ARGUMENT,
         "priority: must be one of sheddable, standard, critical (got 7)"),
    ],
    ids=["above_max", "above_max_of_a_lower_default", "unknown"],
)  # fmt: skip
def test_a_class_the_key_may_not_have_is_refused_before_any_work(
    client: redis.Redis,
    namespace: str,
    model_dir: Path,
    principal: Principal,
    asked: int,
    code: grpc.StatusCode,
    message: str,
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        with pytest.raises((PermissionDeniedError, InvalidRequestError)) as refused:
            await Client(gw, principal=principal, priority=asked).run()
        assert code_for(refused.value) == code
        assert message in str(refused.value)
        await assert_refused_holding_nothing(gw)

    asyncio.run(scenario())


# -- max_tokens ceiling --------------------------------------------------------------
def test_max_tokens_above_the_operators_ceiling_is_refused_naming_it(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, max_tokens_limit=MAX_TOKENS)
        with pytest.raises(InvalidRequestError) as refused:
            await Client(gw, max_tokens=MAX_TOKENS + 1).run()
        assert refused.value.field == "sampling.max_tokens"
        assert f"must be <= {MAX_TOKENS}" in str(refused.value)
        assert "max_tokens_limit" in str(refused.value)
        await assert_refused_holding_nothing(gw)
        at_limit = Client(gw, max_tokens=MAX_TOKENS)
        record = await run_to_the_end(gw, at_limit)
        assert at_limit.received[-1].finished
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


# -- the total deadline ----------------------------------------------------------------
DEADLINE_S = 0.5


@pytest.mark.parametrize("held_at", ["prefill", "next_token"])
def test_the_deadline_ends_the_stream_and_frees_everything(
    client: redis.Redis, namespace: str, model_dir: Path, held_at: str
) -> None:
    """A worker that never answers (prefill) or stops streaming (decode): the request
    ends DEADLINE_EXCEEDED at its deadline, well before any hop's own timeout, with no
    retry; the prefill worker's KV is aborted, the decode stream cancelled."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, request_deadline_s=DEADLINE_S)
        gw.cluster.gates[held_at].hold()
        reader = Client(gw)
        start = time.monotonic()
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(gw.cluster.gates[held_at].arrived.wait(), 10)
        record = only_record(gw)
        with pytest.raises(StreamError) as ended:
            await task
        elapsed = time.monotonic() - start
        assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "request_deadline_s" in str(ended.value)
        assert DEADLINE_S - 0.05 <= elapsed < DEADLINE_S + 1.0
        assert len(gw.cluster.prefills) == 1  # a missed deadline is never retried
        gw.cluster.gates[held_at].proceed.set()
        await assert_nothing_held(gw, record)
        if held_at == "prefill":
            assert gw.cluster.aborts == [("p0:1", record.req.worker_request_id)]
        else:
            assert gw.cluster.decodes[0].cancelled

    asyncio.run(scenario())


def test_the_deadline_passes_while_the_client_is_slow(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """The buffer is full and the client slow, but not yet given up on: the deadline
    ends the request at once (both workers drop it), and the client, when it reads
    again, gets what was buffered, then DEADLINE_EXCEEDED."""

    async def scenario() -> None:
        gw = build_gateway(
            client, namespace, model_dir, request_deadline_s=DEADLINE_S,
            stream_buffer_messages=1, slow_client_timeout_s=30.0,
        )  # fmt: skip
        reader = Client(gw, stall_at=0)
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(reader.stalled.wait(), 10)
        record = only_record(gw)
        await asyncio.wait_for(_state(record, RequestState.CLOSED), 10)  # by the deadline
        assert gw.cluster.decodes[0].cancelled
        reader.resume.set()
        with pytest.raises(StreamError) as ended:
            await task
        assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(reader.received) == 2  # token 1, and the one buffered message
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


async def _state(record: RequestRecord, state: RequestState) -> None:
    while record.state is not state:
        await asyncio.sleep(0.01)


# -- the slow client -------------------------------------------------------------------
STALL_S = 0.3


@pytest.mark.parametrize("buffered", [1, 64], ids=["buffer_full", "relay_over"])
def test_a_client_that_stops_reading_is_disconnected_and_its_request_aborted(
    client: redis.Redis, namespace: str, model_dir: Path, buffered: int
) -> None:
    """The client takes token 1, then nothing. Once messages have waited the slow-client
    timeout (the buffer full while the decode worker streams on, or the relay over with
    the rest unread), the record is closed through its one cleanup (the decode stream
    cancelled, slot, load leases and unused quota given back), the front door is told to
    disconnect with RESOURCE_EXHAUSTED, and the client gets the same if it reads again."""

    async def scenario() -> None:
        gw = build_gateway(
            client, namespace, model_dir, stream_buffer_messages=buffered,
            slow_client_timeout_s=STALL_S,
        )  # fmt: skip
        disconnects = Disconnects()
        reader = Client(gw, stall_at=0, disconnect=disconnects)
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(reader.stalled.wait(), 10)
        record = only_record(gw)
        stalled_at = time.monotonic()
        await asyncio.wait_for(disconnects.called.wait(), 10)
        assert STALL_S - 0.05 <= time.monotonic() - stalled_at < STALL_S + 1.0
        (error,) = disconnects.errors
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stopped reading" in str(error) and "slow_client_timeout_s" in str(error)
        await asyncio.wait_for(_state(record, RequestState.CLOSED), 10)  # before the client
        if buffered == 1:  # the decode worker was still streaming: it was told to stop
            assert gw.cluster.decodes[0].cancelled
        assert gw.cluster.aborts == []  # the KV had been pulled
        reader.resume.set()
        with pytest.raises(StreamError) as ended:
            await task
        assert ended.value is error and len(reader.received) == 1
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_a_slow_client_that_keeps_reading_is_served(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """Each message waits less than the timeout, though the whole stream takes longer:
    the rule is about a client that makes no progress, not a slow one."""

    async def scenario() -> None:
        gw = build_gateway(
            client, namespace, model_dir, stream_buffer_messages=1,
            slow_client_timeout_s=STALL_S,
        )  # fmt: skip
        disconnects = Disconnects()
        received = []
        start = time.monotonic()
        async for msg in gw.service.stream(gw.service.decode(request()), disconnect=disconnects):
            received.append(msg)
            await asyncio.sleep(STALL_S * 0.6)
        assert time.monotonic() - start > STALL_S * 2
        assert received[-1].finished and disconnects.errors == []
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
        assert gw.cluster.leaks() == [] and gw.load_counts() == {"prefill": {}, "decode": {}}

    asyncio.run(scenario())


def test_a_relay_cancelled_from_outside_never_leaves_the_client_waiting(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """The decode call is torn down under the relay (a cancel the gateway did not ask
    for): the client gets CANCELLED instead of waiting forever, and nothing is held."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        gw.cluster.torn_down = True
        gw.cluster.gates["next_token"].hold()
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(gw.cluster.gates["next_token"].arrived.wait(), 10)
        record = only_record(gw)
        gw.cluster.gates["next_token"].proceed.set()
        with pytest.raises(StreamError) as ended:
            await asyncio.wait_for(task, 10)
        assert ended.value.code == grpc.StatusCode.CANCELLED
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_grpc_disconnect_aborts_the_call_with_the_error() -> None:
    """The gRPC front door's `disconnect`: the status goes out at once (abort raises by
    design; the call's own task must not also abort it)."""

    class Context:
        def __init__(self) -> None:
            self.aborted: list[tuple[grpc.StatusCode, str]] = []

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.aborted.append((code, details))
            raise RuntimeError("aborted")  # what grpc.aio's AbortError stands for

    async def scenario() -> None:
        context = Context()
        disconnect = GrpcDisconnect(context)  # type: ignore[arg-type]
        error = StreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the client stopped reading")
        await disconnect(error)
        assert disconnect.done
        assert context.aborted == [(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))]

    asyncio.run(scenario())
