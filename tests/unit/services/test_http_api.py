"""The HTTP front door in process, in front of workers that never answer or are gone:
the stream cap (429), a missed deadline (504), an unreachable worker (503), and a client
that leaves during prefill, all driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from engine.model_spec import ModelSpec
from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.http_api import HttpApi
from services.gateway.service import GatewayService
from services.router.placement import StaticPlacement


@pytest.fixture
def silent_worker() -> Iterator[socket.socket]:
    """A port that accepts TCP connections and never speaks gRPC: calls hang there."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


@contextlib.asynccontextmanager
async def _serve(
    model_dir: Path, worker: str, prefill_timeout_s: float
) -> AsyncIterator[tuple[GatewayService, str]]:
    config = GatewayConfig(
        prefill_workers=worker, decode_workers=worker, max_streams=1,
        prefill_timeout_s=prefill_timeout_s, prefill_retries=0, http_port=0,
    )  # fmt: skip
    spec = ModelSpec.from_dir(model_dir)
    placement = StaticPlacement.from_addresses(config.prefill_list, config.decode_list)
    service = GatewayService(
        config, placement, Tokenizer(model_dir), "m", spec.max_position_embeddings,
        spec.vocab_size,
    )  # fmt: skip
    api = HttpApi(service, drain_s=1.0)
    address = await api.start("127.0.0.1", 0)
    try:
        yield service, f"http://{address}/v1"
    finally:
        await api.stop()
        await service.close()


async def _until(predicate: object, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_cap_deadline_and_unreachable_worker_get_their_http_codes(
    model_dir: Path, silent_worker: socket.socket
) -> None:
    host, port = silent_worker.getsockname()

    async def scenario() -> None:
        async with _serve(model_dir, f"{host}:{port}", 3.0) as (service, base):
            client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
            slow = asyncio.create_task(
                client.completions.create(model="m", prompt="hi", max_tokens=2)
            )
            await _until(lambda: service.active == 1, timeout=5.0)
            with pytest.raises(openai.RateLimitError) as busy:
                await client.completions.create(model="m", prompt="hi", max_tokens=2)
            assert "max_streams" in busy.value.message
            with pytest.raises(openai.APIStatusError) as late:
                await slow
            assert late.value.status_code == 504
            assert late.value.code == "deadline_exceeded"
            assert service.active == 0
            silent_worker.close()  # now the address refuses connections
            with pytest.raises(openai.APIStatusError) as gone:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                )
            assert gone.value.status_code == 503
            assert service.active == 0
            await client.close()

    asyncio.run(scenario())


def test_a_client_leaving_during_prefill_gives_the_slot_back_at_once(
    model_dir: Path, silent_worker: socket.socket
) -> None:
    host, port = silent_worker.getsockname()

    async def scenario() -> float:
        async with _serve(model_dir, f"{host}:{port}", 30.0) as (service, base):
            client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
            call = asyncio.create_task(
                client.completions.create(model="m", prompt="hi", max_tokens=2, stream=True)
            )
            await _until(lambda: service.active == 1, timeout=5.0)
            call.cancel()  # closes the HTTP connection while the prefill call hangs
            with pytest.raises(asyncio.CancelledError):
                await call
            # Far inside the 30 s prefill deadline: the handler was cancelled, not timed
            # out. (Its Abort to the silent worker waits out its own 2 s timeout.)
            elapsed = await _until(lambda: service.active == 0, timeout=5.0)
            await client.close()
            return elapsed

    assert asyncio.run(scenario()) < 5.0
