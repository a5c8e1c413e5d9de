"""The Prefill RPC's handler on a real engine and exporter, cancelled at every point of
its life: queued, mid-prefill (chunked), with token 1 sampled and the KV held for export
but the handler not yet resumed; and the gateway's Abort for a lease nobody pulled,
after the call or while it still runs. Each test ends with the leak check: no block,
no request held or importing, no lease."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.config import TransferConfig
from kvtransfer.exporter import KvExporter
from pdserve.v1 import worker_pb2
from services.common import sampling
from services.prefill.handler import PrefillHandler
from tests.conftest import EngineFactory, assert_no_leaks
from tests.prompts import SHORT, long_prompt
from tests.unit.services.engine_harness import Context, Harness

MAX_TOKENS = 8  # more than one: the KV is exported for a decode worker


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=256)


@pytest.fixture(scope="module")
def exporter(engine: LLMEngine) -> Iterator[KvExporter]:
    exp = KvExporter(engine.handoff, TransferConfig(kv_backend="tcp"), engine_id="p").start()
    yield exp
    exp.close()


def request(engine: LLMEngine, rid: str, prompt: str = SHORT[1]) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=engine.tokenizer.encode(prompt),
        sampling=sampling.to_proto(SamplingParams(max_tokens=MAX_TOKENS)),
    )


async def assert_nothing_held(harness: Harness, exporter: KvExporter) -> None:
    await harness.drained()
    assert_no_leaks(harness.engine)
    assert exporter.stats().leases.active == 0


def run(scenario: object) -> None:
    asyncio.run(scenario)  # type: ignore[arg-type]


async def _cancelled(task: asyncio.Task[worker_pb2.PrefillResponse]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancel_while_queued(engine: LLMEngine, exporter: KvExporter) -> None:
    async def scenario() -> None:
        h = Harness(engine)
        handler = PrefillHandler(h.loop, exporter, "p")
        task = asyncio.create_task(handler.prefill(request(engine, "queued"), Context()))
        await asyncio.sleep(0.05)  # at its first await; no step allowed
        assert h.stepper.taken == 0 and engine.has_unfinished()
        await _cancelled(task)
        await assert_nothing_held(h, exporter)
        h.close()

    run(scenario())


def test_cancel_mid_prefill(engine: LLMEngine, exporter: KvExporter) -> None:
    """A prompt over the step's token budget is prefilled in chunks: cancelled after
    the first chunk, with the request running and its blocks taken."""

    async def scenario() -> None:
        h = Harness(engine)
        handler = PrefillHandler(h.loop, exporter, "p")
        req = request(engine, "chunked", long_prompt(6))
        assert len(req.prompt_token_ids) > engine.config.max_num_batched_tokens
        task = asyncio.create_task(handler.prefill(req, Context()))
        h.stepper.allow(1)
        await h.stepper.taken_at_least(1)
        assert engine.stats().running == 1 and engine.stats().used_blocks > 0
        await _cancelled(task)
        await assert_nothing_held(h, exporter)
        h.close()

    run(scenario())


def test_cancel_with_token_one_sampled_before_the_handler_resumes(
    engine: LLMEngine, exporter: KvExporter
) -> None:
    """The step sampled token 1 and holds the KV for export; its output has not reached
    the handler when the call is cancelled: no export, and the held KV is released."""

    async def scenario() -> None:
        h = Harness(engine)
        h.stepper.hold_outputs = True
        handler = PrefillHandler(h.loop, exporter, "p")
        task = asyncio.create_task(handler.prefill(request(engine, "sampled"), Context()))
        h.stepper.allow(1)
        await h.stepper.taken_at_least(1)
        assert engine.stats().held_requests == 1
        await _cancelled(task)
        h.stepper.release_outputs()
        await assert_nothing_held(h, exporter)
        h.close()

    run(scenario())


def test_abort_of_a_lease_nobody_pulled(engine: LLMEngine, exporter: KvExporter) -> None:
    """The call answered with a KvHandle and the gateway's client left: its Abort drops
    the lease and the held KV."""

    async def scenario() -> None:
        h = Harness(engine)
        h.stepper.free()
        handler = PrefillHandler(h.loop, exporter, "p")
        response = await handler.prefill(request(engine, "exported"), Context())
        assert response.HasField("kv_handle") and exporter.stats().leases.active == 1
        assert handler.abort("exported")
        await assert_nothing_held(h, exporter)
        h.close()

    run(scenario())


def test_abort_while_the_call_still_runs(engine: LLMEngine, exporter: KvExporter) -> None:
    """The gateway's cleanup cancels the call and sends Abort; the Abort may come first."""

    async def scenario() -> None:
        h = Harness(engine)
        handler = PrefillHandler(h.loop, exporter, "p")
        req = request(engine, "racing", long_prompt(6))
        task = asyncio.create_task(handler.prefill(req, Context()))
        h.stepper.allow(1)
        await h.stepper.taken_at_least(1)
        handler.abort("racing")
        await _cancelled(task)
        await assert_nothing_held(h, exporter)
        h.close()

    run(scenario())
