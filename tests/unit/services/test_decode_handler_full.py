"""The Decode handler on a real engine whose KV pool is full when the KV arrives: the
import waits for blocks (holding nothing) and goes ahead once they free; a wait that
runs out ends the call with DecodeFullError (RESOURCE_EXHAUSTED), leaving the prefill
worker's lease for the gateway's next attempt, which may come back here under the same
request id; a cancel while waiting leaves nothing behind. The KV comes from a real
prefill engine and exporter over TCP; each test ends with the leak check on both
engines and the exporter's leases."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine.engine import LLMEngine
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import ImportResult, KvImporter
from services.common.status import DecodeFullError, code_for
from services.decode.handler import DecodeHandler
from services.decode.import_room import ImportRoom, RoomLimits
from services.prefill.handler import PrefillHandler
from tests.conftest import EngineFactory, assert_no_leaks
from tests.unit.services.engine_harness import CallLog, Context, Harness, until
from tests.unit.services.test_decode_handler_cancel import (
    MAX_TOKENS,
    TCP,
    Reader,
    _exported,
    cancelled,
)

POOL_BLOCKS = 8  # the decode engine's whole pool: the filler takes all of it
FILLER = "filler"


@pytest.fixture(scope="module")
def decode_engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=POOL_BLOCKS)


@pytest.fixture(scope="module")
def prefill_engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=256)


@pytest.fixture(scope="module")
def exporter(prefill_engine: LLMEngine) -> Iterator[KvExporter]:
    exp = KvExporter(prefill_engine.handoff, TCP, engine_id="p").start()
    yield exp
    exp.close()


@pytest.fixture(scope="module")
def importer(decode_engine: LLMEngine) -> Iterator[KvImporter]:
    imp = KvImporter(decode_engine.handoff, TCP, engine_id="d")
    yield imp
    imp.close()


def fill(engine: LLMEngine) -> None:
    """Take every block of the pool: an import reserved and never landing."""
    prompt = list(range(100, 99 + POOL_BLOCKS * engine.config.block_size))  # + 1 token: the pool
    engine.handoff.reserve_import(
        RequestSpec(prompt, SamplingParams(max_tokens=1), request_id=FILLER), 5
    )
    assert engine.stats().free_blocks == 0


class WatchedRoom(ImportRoom):
    """Says when an import is waiting (between tries: no import thread in flight)."""

    def __init__(self, max_wait_s: float) -> None:
        super().__init__(RoomLimits(max_wait_s, poll_s=0.05))
        self.waiting = asyncio.Event()

    async def wait(self, ticket: asyncio.Event, until: float) -> bool:
        self.waiting.set()
        return await super().wait(ticket, until)


def handler(h: Harness, importer: KvImporter, room: ImportRoom) -> DecodeHandler:
    return DecodeHandler(h.loop, importer, room=room)


class Tries:
    """Counts the import's tries (each in a worker thread) and passes them on."""

    def __init__(self, fn: Callable[..., ImportResult]) -> None:
        self._fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> ImportResult:
        self.calls += 1
        return self._fn(*args, **kwargs)


class Setup:
    """A free-running decode and prefill engine; the tries of the import are counted."""

    def __init__(self, decode: LLMEngine, prefill: LLMEngine, importer: KvImporter) -> None:
        self.decode = Harness(decode)
        self.prefill = Harness(prefill)
        self.decode.stepper.free()
        self.prefill.stepper.free()
        self.tries = Tries(importer.import_kv)
        importer.import_kv = self.tries  # type: ignore[method-assign]
        self.importer = importer

    async def check_clean(self, exporter: KvExporter) -> None:
        await self.decode.drained()
        await self.prefill.drained()
        assert_no_leaks(self.decode.engine)
        assert_no_leaks(self.prefill.engine)
        assert exporter.stats().leases.active == 0

    def close(self) -> None:
        del self.importer.import_kv
        self.decode.close()
        self.prefill.close()


def test_an_import_waits_for_blocks_then_decodes(
    decode_engine: LLMEngine, prefill_engine: LLMEngine, exporter: KvExporter, importer: KvImporter
) -> None:
    async def scenario() -> None:
        s = Setup(decode_engine, prefill_engine, importer)
        try:
            fill(decode_engine)
            req = await _exported(s.prefill, exporter, "waits")
            reader = Reader(handler(s.decode, importer, WatchedRoom(30.0)).decode(req, Context()))
            task = asyncio.create_task(reader.run())
            await until(lambda: s.tries.calls >= 2)  # refused, waiting, tried again
            assert not task.done() and exporter.stats().leases.active == 1
            assert set(decode_engine.requests) == {FILLER}  # the wait holds nothing
            decode_engine.handoff.cancel_import(FILLER)  # blocks free (no stream ends: the poll)
            await asyncio.wait_for(task, 30)
            assert reader.chunks[-1].finished
            assert sum(len(c.token_ids) for c in reader.chunks) == MAX_TOKENS - 1
            await s.check_clean(exporter)
        finally:
            decode_engine.handoff.cancel_import(FILLER)
            s.close()

    asyncio.run(scenario())


def test_a_wait_that_runs_out_is_resource_exhausted_and_a_retry_here_works(
    decode_engine: LLMEngine, prefill_engine: LLMEngine, exporter: KvExporter, importer: KvImporter
) -> None:
    """The refused call holds nothing and sends no abort (the retry reuses the request
    id here, and a late abort would kill it); the prefill worker keeps the KV for it."""

    async def scenario() -> None:
        s = Setup(decode_engine, prefill_engine, importer)
        aborts = CallLog(decode_engine.abort)
        decode_engine.abort = aborts  # type: ignore[method-assign,assignment]
        try:
            fill(decode_engine)
            req = await _exported(s.prefill, exporter, "full")
            with pytest.raises(DecodeFullError) as full:
                await Reader(
                    handler(s.decode, importer, WatchedRoom(0.3)).decode(req, Context())
                ).run()
            assert code_for(full.value).name == "RESOURCE_EXHAUSTED"
            assert "no room for the KV" in str(full.value) and s.tries.calls >= 2
            assert set(decode_engine.requests) == {FILLER} and aborts.calls == []
            assert exporter.stats().leases.active == 1  # still there for the next attempt
            decode_engine.handoff.cancel_import(FILLER)
            again = Reader(handler(s.decode, importer, WatchedRoom(0.3)).decode(req, Context()))
            await asyncio.wait_for(again.run(), 30)  # the gateway's retry, same id
            assert again.chunks[-1].finished
            await s.check_clean(exporter)
        finally:
            decode_engine.handoff.cancel_import(FILLER)
            del decode_engine.abort
            s.close()

    asyncio.run(scenario())


def test_a_cancel_while_waiting_leaves_nothing_behind(
    decode_engine: LLMEngine, prefill_engine: LLMEngine, exporter: KvExporter, importer: KvImporter
) -> None:
    async def scenario() -> None:
        s = Setup(decode_engine, prefill_engine, importer)
        try:
            fill(decode_engine)
            req = await _exported(s.prefill, exporter, "cancelled")
            room = WatchedRoom(30.0)
            reader = Reader(handler(s.decode, importer, room).decode(req, Context()))
            task = asyncio.create_task(reader.run())
            await asyncio.wait_for(room.waiting.wait(), 30)  # refused once, now waiting
            await cancelled(task)
            decode_engine.handoff.cancel_import(FILLER)
            await asyncio.sleep(0.2)  # a poll's worth: no import may start after the cancel
            assert len(decode_engine.requests) == 0
            # The prefill worker still holds the KV: the gateway's Abort releases it.
            assert exporter.stats().leases.active == 1
            PrefillHandler(s.prefill.loop, exporter, "p").abort(req.request_id)
            await s.check_clean(exporter)
            assert reader.chunks == []
        finally:
            decode_engine.handoff.cancel_import(FILLER)
            s.close()

    asyncio.run(scenario())


def test_a_decode_request_that_fits_does_not_wait(
    decode_engine: LLMEngine, prefill_engine: LLMEngine, exporter: KvExporter, importer: KvImporter
) -> None:
    async def scenario() -> None:
        s = Setup(decode_engine, prefill_engine, importer)
        try:
            req = await _exported(s.prefill, exporter, "fits")
            reader = Reader(handler(s.decode, importer, WatchedRoom(30.0)).decode(req, Context()))
            await asyncio.wait_for(reader.run(), 30)
            assert s.tries.calls == 1 and reader.chunks[-1].finished
            await s.check_clean(exporter)
        finally:
            s.close()

    asyncio.run(scenario())
