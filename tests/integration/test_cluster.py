"""End to end through real processes on 127.0.0.1: gateway, prefill and decode workers
(KV over NIXL), the default model. Streams, cancels, crashes and bad input; every test
that cancels, kills or sends bad input ends with the leak probe (`leak_check`)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import grpc
import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import ChatMessage, Tokenizer
from pdserve.v1 import gateway_pb2
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from services.gateway.access.usage_ledger import UsageOutcome
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.conftest import MODEL_CACHE, EngineFactory
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.usage_check import assert_ledger_matches, ledger_entries
from tests.prompts import long_prompt

# Pins (tests/integration/pins.py): streams equal one engine's output token for token;
# short prompts take the hop and the tests kill prefill workers by name.
pytestmark = pytest.mark.pins(Pin.FLOAT32, Pin.PREFILL_HOP)

QUESTION = "What is the capital of France? Answer in one sentence."


def _cluster(**overrides: object) -> LocalCluster:
    settings: dict[str, object] = {"gateway_port": 0, "model_cache_dir": MODEL_CACHE,
                                   "worker_kv_cache_bytes": 96 << 20}  # fmt: skip
    settings.update(overrides)
    cluster = LocalCluster(ClusterConfig(**settings))  # type: ignore[arg-type]
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = _cluster(num_prefill=2, num_decode=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=200)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def _collect(address: str, **kwargs: object) -> list[object]:
    prompt, messages = kwargs.pop("prompt", None), kwargs.pop("messages", None)
    request = build_request(prompt, RequestOptions(**kwargs), messages=messages)  # type: ignore[arg-type]
    async with GatewayClient(address) as client:
        return [m async for m in client.generate(request)]


async def _idle(address: str, timeout: float) -> list[object]:
    """Poll until every worker holds no blocks; returns the last worker stats (the
    caller asserts on them: reaching the timeout is not an error here)."""
    end = time.monotonic() + timeout
    async with GatewayClient(address) as client:
        while True:
            workers = list((await client.cluster_status()).workers)
            if all(w.used_blocks == 0 and w.held_blocks == 0 and w.running == 0 for w in workers):
                return workers
            if time.monotonic() > end:
                return workers
            await asyncio.sleep(0.05)


def test_stream_equals_single_engine(cluster: LocalCluster, reference: LLMEngine) -> None:
    msgs = run(_collect(cluster.gateway_address, messages=[("user", QUESTION)], max_tokens=24))
    prompt = reference.tokenizer.encode_chat([ChatMessage("user", QUESTION)])
    (expected,) = reference.generate([prompt], SamplingParams(max_tokens=24))
    tokens = [t for m in msgs for t in m.token_ids]  # type: ignore[attr-defined]
    assert tokens == expected
    text = "".join(m.text for m in msgs)  # type: ignore[attr-defined]
    assert text == reference.tokenizer.decode(expected)
    first, last = msgs[0], msgs[-1]
    # Token 1 comes from the prefill worker before the decode worker is involved.
    assert first.prefill_worker.startswith("prefill-") and not first.decode_worker  # type: ignore[attr-defined]
    assert len(first.token_ids) == 1  # type: ignore[attr-defined]
    assert last.finished and last.usage.completion_tokens == len(expected)  # type: ignore[attr-defined]
    assert last.usage.prompt_tokens == len(prompt)  # type: ignore[attr-defined]


def test_cancel_frees_blocks_on_both_workers_within_a_second(
    cluster: LocalCluster, model_dir: Path
) -> None:
    probe = start_probe(cluster)

    async def scenario() -> list[object]:
        async with GatewayClient(cluster.gateway_address) as client:
            call = client.generate(
                build_request(long_prompt(3), RequestOptions(max_tokens=400, ignore_eos=True))
            )
            seen: list[gateway_pb2.GenerateResponse] = []
            async for msg in call:
                seen.append(msg)
                if len(seen) == 4:
                    break
            call.cancel()
            received.extend(seen)
        return await _idle(cluster.gateway_address, timeout=1.0)

    received: list[gateway_pb2.GenerateResponse] = []
    workers = run(scenario())
    assert all(w.used_blocks == 0 and w.held_blocks == 0 for w in workers), workers  # type: ignore[attr-defined]
    assert_cluster_clean(probe)
    # Its usage entry says it was cancelled, with the tokens handed towards the client
    # (those it read, and any that were on their way when it went).
    entry = ledger_entries(cluster, [received[0].request_id])[received[0].request_id]
    tokens = sum(len(m.token_ids) for m in received)
    assert entry.outcome is UsageOutcome.CANCELLED
    assert entry.prompt_tokens == len(Tokenizer(model_dir).encode(long_prompt(3)))
    assert tokens <= entry.completion_tokens < 400


@pytest.mark.parametrize(
    ("kwargs", "code", "needle"),
    [
        ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ({"prompt": "hi " * 9000}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (
            {"prompt": "hi", "temperature": -1.0},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
        ({"prompt": "hi", "top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        (
            {"prompt": "hi", "max_tokens": 0},
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.max_tokens",
        ),
        ({"prompt": "hi", "max_tokens": 9000}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ({"prompt": "hi", "model": "gpt-9"}, grpc.StatusCode.NOT_FOUND, "model"),
        ({"messages": [("wizard", "hi")]}, grpc.StatusCode.INVALID_ARGUMENT, "role"),
    ],
)
def test_bad_input_gets_typed_status_and_servers_stay_up(
    cluster: LocalCluster, kwargs: dict[str, object], code: grpc.StatusCode, needle: str
) -> None:
    probe = start_probe(cluster)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run(_collect(cluster.gateway_address, **kwargs))
    assert info.value.code() == code
    assert needle in (info.value.details() or "")
    msgs = run(_collect(cluster.gateway_address, prompt="Hello", max_tokens=3))
    assert msgs[-1].finished  # type: ignore[attr-defined]
    assert_cluster_clean(probe)


def test_dead_prefill_worker_is_retried_on_the_other(cluster: LocalCluster) -> None:
    probe = start_probe(cluster)
    victim = next(c for c in cluster.children if c.name == "prefill-0")
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    # Round robin sends one of two consecutive requests to the dead worker first.
    finals = []
    for _ in range(2):
        msgs = run(_collect(cluster.gateway_address, prompt="The sea is", max_tokens=5))
        assert msgs[-1].finished  # type: ignore[attr-defined]
        assert msgs[0].prefill_worker == "prefill-1"  # type: ignore[attr-defined]
        finals.append(msgs[-1])
    assert_cluster_clean(probe)
    assert_ledger_matches(cluster, finals)  # type: ignore[arg-type]  # a retry bills once


def test_usage_ledger_and_tenant_metrics_match_the_responses(cluster: LocalCluster) -> None:
    """Forks and plain requests: each one's ledger entry is its response's usage, and the
    per-tenant counters (the anonymous tenant here) move by the same sums."""
    port = cluster.gateways[0].metrics_port
    assert port is not None
    before = scrape(port)

    async def scenario() -> list[gateway_pb2.GenerateResponse]:
        forked = build_request(
            QUESTION, RequestOptions(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
        )
        forked.sampling.n = 3
        plain = build_request("The sea is", RequestOptions(max_tokens=5))
        async with GatewayClient(cluster.gateway_address) as client:
            fork_msgs = [m async for m in client.generate(forked)]
            plain_msgs = [m async for m in client.generate(plain)]
        fork_tokens = sum(len(m.token_ids) for m in fork_msgs)
        assert fork_msgs[-1].usage.completion_tokens == fork_tokens == 18  # every fork's
        return [fork_msgs[-1], plain_msgs[-1]]

    finals = cast(list[gateway_pb2.GenerateResponse], run(scenario()))
    assert_ledger_matches(cluster, finals)
    after = scrape(port)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tenant = "tenant=-"
    finished = f"pdserve_tenant_requests_total{{outcome=finished,priority=standard,{tenant}}}"
    assert moved(finished) == 2
    for kind, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
        want = sum(getattr(m.usage, field) for m in finals)
        assert moved(f"pdserve_tenant_tokens_total{{kind={kind},{tenant}}}") == want
    met = {
        slo: moved(f"pdserve_tenant_slo_met_total{{priority=standard,slo={slo},{tenant}}}")
        for slo in ("ttft", "itl", "both")
    }
    assert met["both"] <= min(met["ttft"], met["itl"]) and max(met.values()) <= 2, met


def test_stream_cap_and_dead_decode_worker() -> None:
    c = _cluster(num_prefill=1, num_decode=1, max_streams=1)
    try:
        probe = start_probe(c)

        async def scenario() -> tuple[grpc.StatusCode, float, grpc.StatusCode]:
            async with GatewayClient(c.gateway_address) as client:
                call = client.generate(
                    build_request(long_prompt(1), RequestOptions(max_tokens=400, ignore_eos=True))
                )
                it = call.__aiter__()
                for _ in range(3):
                    await it.__anext__()
                with pytest.raises(grpc.aio.AioRpcError) as busy:
                    await client.complete(build_request("hi", RequestOptions(max_tokens=2)))
                decode = next(ch for ch in c.children if ch.name == "decode-0")
                os.kill(decode.proc.pid, signal.SIGKILL)
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as dead:
                    async for _ in it:
                        pass
                return busy.value.code(), time.monotonic() - start, dead.value.code()

        busy_code, elapsed, dead_code = run(scenario())  # type: ignore[misc]
        assert busy_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dead_code == grpc.StatusCode.UNAVAILABLE
        assert elapsed < 2.0
        assert_cluster_clean(probe)  # the prefill worker and the gateway hold nothing
    finally:
        c.stop()


def test_mixed_workers_serve_whole_requests(reference: LLMEngine) -> None:
    c = _cluster(num_prefill=0, num_decode=1)
    try:
        probe = start_probe(c)
        msgs = run(_collect(c.gateway_address, prompt="Once upon a time", max_tokens=12))
        (expected,) = reference.generate(
            [reference.tokenizer.encode("Once upon a time")], SamplingParams(max_tokens=12)
        )
        assert [t for m in msgs for t in m.token_ids] == expected  # type: ignore[attr-defined]
        assert msgs[0].prefill_worker == "mixed-0"  # type: ignore[attr-defined]
        assert_cluster_clean(probe)
        procs = [ch.proc for ch in c.children]
    finally:
        c.stop()
    assert all(p.poll() is not None for p in procs), "stop() left a process running"
