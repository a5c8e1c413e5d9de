"""The gateway when a decode worker refuses a request before its first chunk (no room
for the KV: RESOURCE_EXHAUSTED; unreachable: UNAVAILABLE), on real Redis in front of
fake workers: the decode side is placed again, on another worker or, when every one was
full, on the same one after a backoff, and the new worker pulls the same prefill lease;
the refused worker's load lease goes back at once. Retrying ends at the first-token
deadline, or when only unreachable workers are left. Every test ends with the leak
check (`assert_nothing_held`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import redis

from services.gateway.stream.errors import StreamError
from services.gateway.stream.request_record import RequestRecord, RequestState
from tests.unit.services.gateway_fakes import (
    DECODE_TOKENS,
    Client,
    Gateway,
    ThreadGate,
    assert_nothing_held,
    build_gateway,
    only_record,
    until,
)
from tests.unit.services.test_request_lifecycle import cancel

FULL = grpc.StatusCode.RESOURCE_EXHAUSTED
GONE = grpc.StatusCode.UNAVAILABLE


def decoded_on(gw: Gateway) -> list[str]:
    return [call.address for call in gw.cluster.decodes]


@pytest.mark.parametrize("code", [FULL, GONE], ids=["full", "unreachable"])
def test_a_refused_decode_moves_to_the_other_worker(
    client: redis.Redis, namespace: str, model_dir: Path, code: grpc.StatusCode
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=2)
        gw.cluster.decode_refusals = [code]
        gw.cluster.gates["next_token"].hold()
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(gw.cluster.gates["next_token"].arrived.wait(), 10)
        refused, taken = decoded_on(gw)
        assert refused != taken
        # The refused worker's load went back; the prefill worker's stays until the end.
        want = {"prefill": {"p0": 1}, "decode": {taken.split(":")[0]: 1}}
        await until(lambda: gw.load_counts() == want)
        record = only_record(gw)
        gw.cluster.gates["next_token"].proceed.set()
        await task
        assert reader.received[-1].finished
        assert {m.decode_worker for m in reader.received} == {"", taken.split(":")[0]}
        assert sum(len(m.token_ids) for m in reader.received) == 1 + len(DECODE_TOKENS)
        assert gw.cluster.aborts == []  # the second worker pulled the KV
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_a_single_full_decode_worker_is_tried_again_after_a_backoff(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        gw.cluster.decode_refusals = [FULL, FULL]
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await until(lambda: len(gw.service.book.live()) == 1)
        record = only_record(gw)
        await task
        assert decoded_on(gw) == ["d0:1"] * 3
        assert reader.received[-1].finished and gw.cluster.aborts == []
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_a_decode_worker_full_past_the_first_token_deadline(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """Token 1 was streamed; the request ends DEADLINE_EXCEEDED naming the limit, and
    the prefill worker's KV, never pulled, is aborted."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, first_token_timeout_s=0.6)
        gw.cluster.decode_refusals = [FULL] * 100
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await until(lambda: len(gw.service.book.live()) == 1)
        record = only_record(gw)
        with pytest.raises(StreamError) as failed:
            await task
        assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert str(failed.value).startswith("first_token_timeout_s: ")
        assert "decode worker d0: no room for the KV" in str(failed.value)
        assert len(reader.received) == 1 and len(gw.cluster.decodes) >= 2
        assert gw.cluster.aborts == [("p0:1", record.req.worker_request_id)]
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_no_reachable_decode_worker_left_fails_at_once(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        gw.cluster.decode_refusals = [GONE]
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await until(lambda: len(gw.service.book.live()) == 1)
        record = only_record(gw)
        with pytest.raises(StreamError) as failed:
            await task
        assert failed.value.code == GONE and "decode worker d0" in str(failed.value)
        assert decoded_on(gw) == ["d0:1"]  # not tried again: it is gone
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


@pytest.mark.parametrize("times", [1, 2], ids=["cancelled", "cancelled_twice"])
def test_cancel_while_placing_the_decode_side_again(
    client: redis.Redis, namespace: str, model_dir: Path, times: int
) -> None:
    """Both decode placements' load leases go back (the new one was taken in Redis, its
    answer not back yet), and the prefill worker gets an Abort for the un-pulled KV."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=2)
        gw.cluster.decode_refusals = [FULL]
        gate = ThreadGate()
        gate.hold()
        gw.router.route_decode = gate.wrap(gw.router.route_decode)  # type: ignore[method-assign]
        task = asyncio.create_task(Client(gw).run())
        await gate.reached()
        record: RequestRecord = only_record(gw)
        assert record.state is RequestState.ROUTING
        await cancel(task, record, times)
        gate.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_nothing_held(gw, record)
        assert gw.cluster.aborts == [("p0:1", record.req.worker_request_id)]

    asyncio.run(scenario())
