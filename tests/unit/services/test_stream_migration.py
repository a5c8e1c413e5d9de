"""The gateway when a decode worker dies mid-stream, on real Redis in front of fake
workers: the stream moves to another decode worker, which is sent every token already
streamed (`resume_token_ids`) and goes on after them; the client sees each token once
and no error. The prefill worker exports the prompt's KV again for the new worker; when
it cannot (no prefill hop, its Prefill fails, the import fails) the new worker computes
the prompt, within the same move. At most `max_migrations` moves, then the worker's
status. Every test ends with the leak check (`assert_nothing_held`). On real processes:
test_faults.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import redis

from services.gateway.stream.errors import StreamError
from services.router.keyspace import Keyspace
from tests.unit.services.gateway_fakes import (
    DECODE_TOKENS,
    FIRST_TOKEN,
    assert_nothing_held,
    build_gateway,
    start_request,
)

ALL_TOKENS = [FIRST_TOKEN, *DECODE_TOKENS]


def test_a_stream_whose_decode_worker_dies_moves_and_goes_on(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=2)
        gw.cluster.decode_deaths = [2]  # the first call dies after two decode tokens
        reader, task, record = await start_request(gw)
        await task
        lost, moved = gw.cluster.decodes
        assert lost.address != moved.address
        assert list(moved.request.resume_token_ids) == ALL_TOKENS[:3]
        # The prefill worker exported the prompt again: the new worker imports it.
        assert moved.request.HasField("kv_handle") and len(gw.cluster.prefills) == 2
        assert gw.cluster.prefills[0] == gw.cluster.prefills[1]
        assert [t for m in reader.received for t in m.token_ids] == ALL_TOKENS
        assert reader.received[-1].finished
        assert reader.received[-1].usage.completion_tokens == len(ALL_TOKENS)
        workers = [m.decode_worker for m in reader.received if m.decode_worker]
        assert workers == [lost.address.split(":")[0]] * 2 + [moved.address.split(":")[0]]
        await assert_nothing_held(gw, record)
        # The dead worker was reported: every router skips it until the mark runs out.
        dead = lost.address.split(":")[0]
        assert client.hget(Keyspace(namespace).worker(dead), "down_until") is not None
        assert gw.router.stats.marked_down == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("deaths", "max_migrations"), [([2], 0), ([1, 1], 1)], ids=["off", "limit"]
)
def test_a_stream_past_its_move_limit_ends_with_the_workers_status(
    client: redis.Redis,
    namespace: str,
    model_dir: Path,
    deaths: list[int | None],
    max_migrations: int,
) -> None:
    async def scenario() -> None:
        gw = build_gateway(
            client, namespace, model_dir, decode_workers=2, max_migrations=max_migrations
        )
        gw.cluster.decode_deaths = list(deaths)
        reader, task, record = await start_request(gw)
        with pytest.raises(StreamError) as failed:
            await task
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(gw.cluster.decodes) == max_migrations + 1
        sent = [t for m in reader.received for t in m.token_ids]
        assert sent == ALL_TOKENS[: len(sent)]  # nothing repeated before the end
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_a_stream_with_no_decode_worker_left_ends_unavailable(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=1)
        gw.cluster.decode_deaths = [2]
        _, task, record = await start_request(gw)
        with pytest.raises(StreamError) as failed:
            await task
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert "decode worker d0" in str(failed.value)
        assert len(gw.cluster.decodes) == 1
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


@pytest.mark.parametrize("case", ["prefill_unreachable", "import_lost"])
def test_a_moved_stream_without_the_prompts_kv_recomputes_it_in_the_same_move(
    client: redis.Redis, namespace: str, model_dir: Path, case: str
) -> None:
    """A prefill worker that cannot export the prompt again, or an import of that
    export that fails: the new decode worker computes the prompt itself, and that is
    still one move (max_migrations 1 lets it finish)."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=2, max_migrations=1)
        gw.cluster.decode_deaths = [2]
        if case == "prefill_unreachable":
            gw.cluster.unreachable_prefills = {2}
        if case == "import_lost":
            gw.cluster.lost_imports = {1}
        reader, task, record = await start_request(gw)
        await task
        assert [t for m in reader.received for t in m.token_ids] == ALL_TOKENS
        last = gw.cluster.decodes[-1]
        assert list(last.request.resume_token_ids) == ALL_TOKENS[:3]
        assert not last.request.HasField("kv_handle")
        assert last.address != gw.cluster.decodes[0].address
        assert len(gw.cluster.prefills) == 2
        assert len(gw.cluster.decodes) == (3 if case == "import_lost" else 2)
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_a_stream_whose_kv_was_prefilled_again_may_still_move(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    """The hand-off lost the KV (the same decode worker prefilled it again, resuming after
    token 1) and later that worker died: the re-prefill did not use up the one move, so
    the stream moves and finishes."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, decode_workers=2, max_migrations=1)
        gw.cluster.lost_imports = {0}
        gw.cluster.decode_deaths = [None, 2]  # the re-prefilled call dies after 2 tokens
        reader, task, record = await start_request(gw)
        await task
        imported, again, moved = gw.cluster.decodes
        assert again.address == imported.address and not again.request.HasField("kv_handle")
        assert moved.address != again.address
        assert list(moved.request.resume_token_ids) == ALL_TOKENS[:3]
        assert [t for m in reader.received for t in m.token_ids] == ALL_TOKENS
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())
