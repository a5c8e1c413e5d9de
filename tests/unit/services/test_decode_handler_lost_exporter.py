"""The Decode handler when the KV's exporter cannot be reached (it died, or restarted on
other ports): the import fails with NOT_FOUND, as for a lease that ended, not with
UNAVAILABLE, which the gateway would read as this decode worker being gone. The KV comes
from a real prefill engine and exporter over TCP; the handle then names a port where
nothing listens. Ends with the leak check on the decode engine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from engine.engine import LLMEngine
from kvtransfer.errors import LeaseExpiredError, PeerUnavailableError
from kvtransfer.exporter import KvExporter
from kvtransfer.importer import KvImporter
from services.common.status import code_for
from services.decode.handler import DecodeHandler
from services.prefill.handler import PrefillHandler
from tests.conftest import EngineFactory, assert_no_leaks
from tests.unit.services.engine_harness import Context, Harness
from tests.unit.services.test_decode_handler_cancel import TCP, Reader, _exported

# Run alone (`make test`'s serial phase): a port let go and taken again.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def engines(make_engine: EngineFactory) -> tuple[LLMEngine, LLMEngine]:
    return make_engine(num_kv_blocks=64), make_engine(num_kv_blocks=64)


@pytest.fixture(scope="module")
def exporter(engines: tuple[LLMEngine, LLMEngine]) -> Iterator[KvExporter]:
    exp = KvExporter(engines[0].handoff, TCP, engine_id="p").start()
    yield exp
    exp.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_exporter_is_reported_as_lost_kv(
    engines: tuple[LLMEngine, LLMEngine], exporter: KvExporter
) -> None:
    prefill_engine, decode_engine = engines

    async def scenario() -> None:
        prefill, decode = Harness(prefill_engine), Harness(decode_engine)
        prefill.stepper.free()
        decode.stepper.free()
        importer = KvImporter(decode_engine.handoff, TCP, engine_id="d")
        try:
            req = await _exported(prefill, exporter, "gone")
            req.kv_handle.transfer_address = f"127.0.0.1:{_closed_port()}"
            with pytest.raises(LeaseExpiredError) as lost:
                await Reader(DecodeHandler(decode.loop, importer).decode(req, Context())).run()
            assert code_for(lost.value).name == "NOT_FOUND"
            assert isinstance(lost.value.__cause__, PeerUnavailableError)
            assert "exporter cannot be reached" in str(lost.value)
            await decode.drained()
            assert_no_leaks(decode_engine)
            # The prefill side is untouched: the gateway's Abort frees its lease.
            assert exporter.stats().leases.active == 1
            PrefillHandler(prefill.loop, exporter, "p").abort(req.request_id)
            assert exporter.stats().leases.active == 0
        finally:
            importer.close()
            decode.close()
            prefill.close()

    asyncio.run(scenario())
