"""The HTTP front door in process, in front of workers that never answer or are gone:
the stream cap (429), a missed deadline (504), an unreachable worker (503), a client
that leaves during prefill, and the priority header (400 unknown, 403 above the key's
highest), all driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.model_spec import ModelSpec
from engine.tokenizer import Tokenizer
from services.gateway.access.auth import ApiKeys
from services.gateway.access.gate import Access
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission import Admission
from services.gateway.models.backend import SharedParts
from services.gateway.models.catalog import build_catalog
from services.gateway.models.served_model import ServedModelSpec
from services.gateway.openai.http_api import HttpApi
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
    model_dir: Path, worker: str, prefill_timeout_s: float, **config: Any
) -> AsyncIterator[tuple[GatewayService, str]]:
    access = config.pop("access", None)
    config.setdefault("local_prefill_max_tokens", 0)  # the prefill hop it times out on
    cfg = GatewayConfig(
        prefill_workers=worker, decode_workers=worker, max_streams=1,
        prefill_timeout_s=prefill_timeout_s, prefill_retries=0, http_port=0, **config,
    )  # fmt: skip
    spec = ModelSpec.from_dir(model_dir)
    placement = StaticPlacement.from_addresses(cfg.prefill_list, cfg.decode_list)
    parts = SharedParts(access or Access.open())
    model = ServedModelSpec(
        "m", Tokenizer(model_dir), spec.max_position_embeddings, spec.vocab_size, placement,
        Admission(cfg),
    )  # fmt: skip
    service = GatewayService(cfg, build_catalog([model], parts), parts)
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


def test_priority_header_unknown_is_400_and_above_the_key_is_403(
    model_dir: Path, silent_worker: socket.socket, tmp_path: Path
) -> None:
    """Both are refused before anything is placed: the worker (which never answers)
    is not called, and no stream slot is taken."""
    keys = tmp_path / "keys"
    keys.write_text("acme acme-secret-key-0001\nbatch batch-secret-key-0002 class=sheddable\n")
    host, port = silent_worker.getsockname()

    async def scenario() -> None:
        access = Access(ApiKeys.from_file(keys), None)
        async with _serve(model_dir, f"{host}:{port}", 3.0, access=access) as (service, base):
            acme = openai.AsyncOpenAI(base_url=base, api_key="acme-secret-key-0001",
                                      max_retries=0)  # fmt: skip
            with pytest.raises(openai.BadRequestError) as unknown:
                await acme.completions.create(
                    model="m", prompt="hi", max_tokens=2,
                    extra_headers={"x-pdserve-priority": "urgent"},
                )  # fmt: skip
            assert unknown.value.param == "x-pdserve-priority"
            assert "sheddable, standard, critical" in unknown.value.message
            for key in ("acme-secret-key-0001", "batch-secret-key-0002"):
                caller = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
                with pytest.raises(openai.PermissionDeniedError) as denied:
                    await caller.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                        extra_headers={"X-PDServe-Priority": "Critical"},
                    )  # fmt: skip
                assert "may ask for at most standard, not critical" in denied.value.message
                await caller.close()
            with pytest.raises(openai.BadRequestError) as too_many:
                await acme.completions.create(model="m", prompt="hi", max_tokens=4097)
            assert too_many.value.param == "max_tokens" and "4096" in too_many.value.message
            assert service.active == 0 and len(service.book) == 0
            await acme.close()

    asyncio.run(scenario())
