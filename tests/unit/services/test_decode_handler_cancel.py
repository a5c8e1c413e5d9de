"""The Decode RPC's handler on a real engine, cancelled at every point of its life: a
mixed request queued, with its first chunk handed out, waiting for a later token, and
with its last output not yet read; an imported request before its import reserved
anything, once the import has landed but before the handler resumed, and waiting for
its first token. The KV comes from a real prefill engine and exporter over TCP. Each
test ends with the leak check on the decode engine (and, for imports, on the prefill
engine and its leases): no block, no request held or importing, no lease."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import KvImporter
from pdserve.v1 import worker_pb2
from services.common import sampling
from services.decode.handler import DecodeHandler
from services.prefill.handler import PrefillHandler
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT
from tests.unit.services.engine_harness import CallLog, Context, Harness, ThreadHold, until

MAX_TOKENS = 6
TCP = TransferConfig(kv_backend="tcp", kv_transfer_timeout_s=10.0)


@pytest.fixture(scope="module")
def decode_engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=256)


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


def decode_request(engine: LLMEngine, rid: str) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=engine.tokenizer.encode(SHORT[1]),
        sampling=sampling.to_proto(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)),
    )


class Reader:
    """Reads a Decode stream as the gRPC server would; stops reading (without closing)
    after `stall_at` chunks."""

    def __init__(self, stream: AsyncIterator[worker_pb2.DecodeChunk], stall_at: int = 0):
        self.stream = stream
        self.stall_at = stall_at
        self.chunks: list[worker_pb2.DecodeChunk] = []
        self.stalled = asyncio.Event()

    async def run(self) -> None:
        async with contextlib.aclosing(self.stream) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                self.chunks.append(chunk)
                if len(self.chunks) == self.stall_at:
                    self.stalled.set()
                    await asyncio.Event().wait()


async def cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def nothing_held(harness: Harness) -> None:
    await harness.drained()
    assert_no_leaks(harness.engine)


async def gone_after_one_step(harness: Harness) -> None:
    """The next step takes the cancel's abort: the request leaves the engine then, rather
    than decoding on to max_tokens for nobody (which a leak check alone would miss)."""
    harness.stepper.allow(1)
    await harness.stepper.taken_at_least(harness.stepper.taken + 1)
    assert not harness.engine.requests


# -- a mixed request: the decode worker computes the prompt itself ------------------
def test_cancel_while_queued(decode_engine: LLMEngine) -> None:
    async def scenario() -> None:
        h = Harness(decode_engine)
        handler = DecodeHandler(h.loop, None)
        reader = Reader(handler.decode(decode_request(decode_engine, "queued"), Context()))
        task = asyncio.create_task(reader.run())
        await asyncio.sleep(0.05)  # at its first await; no step allowed
        assert h.stepper.taken == 0 and decode_engine.has_unfinished()
        await cancelled(task)
        await gone_after_one_step(h)
        await nothing_held(h)
        h.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("point", ["chunk_handed_out", "waiting_for_a_token"])
def test_cancel_mid_stream(decode_engine: LLMEngine, point: str) -> None:
    """After the first chunk: while the reader has it and reads no further (the stream
    is closed at its `yield`), or while the handler waits for the next token."""

    async def scenario() -> None:
        h = Harness(decode_engine)
        handler = DecodeHandler(h.loop, None)
        stall = 1 if point == "chunk_handed_out" else 0
        reader = Reader(handler.decode(decode_request(decode_engine, point), Context()), stall)
        task = asyncio.create_task(reader.run())
        h.stepper.allow(1)
        await h.stepper.taken_at_least(1)
        await asyncio.wait_for(_chunks(reader, 1), 10)
        await asyncio.sleep(0.05)  # the reader stalls, or the handler awaits its queue
        assert decode_engine.stats().running == 1
        await cancelled(task)
        await gone_after_one_step(h)
        await nothing_held(h)
        assert len(reader.chunks) == 1
        h.close()

    asyncio.run(scenario())


def test_cancel_with_the_last_output_unread(decode_engine: LLMEngine) -> None:
    """The engine finished the request; its last output has not reached the handler."""

    async def scenario() -> None:
        h = Harness(decode_engine)
        handler = DecodeHandler(h.loop, None)
        reader = Reader(handler.decode(decode_request(decode_engine, "unread"), Context()))
        task = asyncio.create_task(reader.run())
        h.stepper.allow(MAX_TOKENS - 1)
        await asyncio.wait_for(_chunks(reader, MAX_TOKENS - 1), 10)
        h.stepper.hold_outputs = True
        h.stepper.allow(1)
        await h.stepper.taken_at_least(MAX_TOKENS)
        await cancelled(task)
        h.stepper.release_outputs()
        await nothing_held(h)
        assert not any(c.finished for c in reader.chunks)
        h.close()

    asyncio.run(scenario())


async def _chunks(reader: Reader, n: int) -> None:
    while len(reader.chunks) < n:
        await asyncio.sleep(0.01)


# -- an imported request: the KV comes from the prefill worker ---------------------
async def _exported(prefill: Harness, exporter: KvExporter, rid: str) -> worker_pb2.DecodeRequest:
    """Prefill on the prefill engine; the Decode request that carries its KvHandle."""
    handler = PrefillHandler(prefill.loop, exporter, "p")
    req = decode_request(prefill.engine, rid)
    first = await handler.prefill(
        worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling
        ),
        Context(),
    )
    req.kv_handle.CopyFrom(first.kv_handle)
    return req


@pytest.mark.parametrize("point", ["import_not_started", "import_landed", "first_token"])
def test_cancel_an_imported_request(
    decode_engine: LLMEngine,
    prefill_engine: LLMEngine,
    exporter: KvExporter,
    importer: KvImporter,
    point: str,
) -> None:
    """Cancelled before the import reserved anything, after it committed the request but
    before the handler resumed, or while waiting for the first decode token. The import
    cannot be stopped: it runs to its end (its pull releases the prefill worker's lease)
    and the request is aborted after it, although the engine dropped the abort that the
    cancel itself sent while it did not know the request yet."""

    async def scenario() -> None:
        prefill = Harness(prefill_engine)
        prefill.stepper.free()
        h = Harness(decode_engine)
        hold = ThreadHold(importer.import_kv, after=point != "import_not_started")
        importer.import_kv = hold  # type: ignore[method-assign]
        aborts = CallLog(decode_engine.abort)
        decode_engine.abort = aborts  # type: ignore[method-assign]
        if point == "first_token":
            hold.proceed.set()
        try:
            req = await _exported(prefill, exporter, point)
            assert exporter.stats().leases.active == 1
            reader = Reader(DecodeHandler(h.loop, importer).decode(req, Context()))
            task = asyncio.create_task(reader.run())
            await hold.reached()
            if point == "first_token":
                await hold.done()
                await asyncio.sleep(0.05)  # the handler awaits its first output; no step
                assert len(decode_engine.requests) == 1
            await cancelled(task)
            h.stepper.allow(1)  # the engine takes the cancel's abort now
            await h.stepper.taken_at_least(1)
            hold.proceed.set()  # the import thread goes on after its caller left
            await hold.done()
            if point != "first_token":  # the handler aborts again once the import is over
                await until(lambda: len(aborts.calls) == 2)
                h.stepper.allow(1)
                await h.stepper.taken_at_least(2)
            assert not decode_engine.requests  # aborted, not decoding to max_tokens
            await nothing_held(h)
            await nothing_held(prefill)
            assert exporter.stats().leases.active == 0
            assert reader.chunks == []
        finally:
            hold.proceed.set()
            del importer.import_kv
            del decode_engine.abort
            h.close()
            prefill.close()

    asyncio.run(scenario())
