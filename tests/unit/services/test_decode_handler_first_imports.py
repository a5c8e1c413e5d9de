"""Imports that reach a decode worker together, before it has met the prefill worker's
exporter: each must find the one channel the first handshake opened. Two handshakes
used to connect the same exporter twice, and the second connect closed the channel the
first import was releasing its lease over; both imports then failed as lost KV, and the
prefill worker's leases ran out unreleased (seen in CI: expired leases on a fresh
cluster). The KV comes from a real prefill engine and exporter over TCP; the test ends
with the leak checks on both engines and the exporter's leases."""

from __future__ import annotations

import asyncio

from engine.engine import LLMEngine
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import KvImporter
from services.decode.handler import DecodeHandler
from tests.conftest import assert_no_leaks
from tests.unit.services.engine_harness import Context, Harness
from tests.unit.services.test_decode_handler_cancel import MAX_TOKENS, TCP, Reader, _exported

# A prefill and a decode engine and the prefill engine's exporter over TCP: the lost
# exporter test's fixtures (each module gets its own).
from tests.unit.services.test_decode_handler_lost_exporter import engines, exporter

__all__ = ["engines", "exporter"]  # fixtures: used by name, not by reference

TOGETHER = 6


def test_imports_arriving_together_share_one_handshake(
    engines: tuple[LLMEngine, LLMEngine], exporter: KvExporter
) -> None:
    prefill_engine, decode_engine = engines

    async def scenario() -> None:
        prefill, decode = Harness(prefill_engine), Harness(decode_engine)
        prefill.stepper.free()
        decode.stepper.free()
        importer = KvImporter(decode_engine.handoff, TCP, engine_id="d")
        try:
            requests = [await _exported(prefill, exporter, f"t{i}") for i in range(TOGETHER)]
            assert exporter.stats().leases.active == TOGETHER
            handler = DecodeHandler(decode.loop, importer)
            readers = [Reader(handler.decode(req, Context())) for req in requests]
            # Each Decode call imports in its own worker thread: all reach the
            # handshake at once.
            await asyncio.gather(*(r.run() for r in readers))
            assert importer.handshakes == 1
            # The first token came with the handle; the decode worker streams the rest.
            streamed = [sum(len(c.token_ids) for c in r.chunks) for r in readers]
            assert streamed == [MAX_TOKENS - 1] * TOGETHER
            assert exporter.stats().leases.active == 0
            await decode.drained()
            await prefill.drained()
            assert_no_leaks(decode_engine)
            assert_no_leaks(prefill_engine)
        finally:
            importer.close()
            decode.close()
            prefill.close()

    asyncio.run(scenario())
