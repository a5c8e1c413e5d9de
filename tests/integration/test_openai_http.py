"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client against
real processes on 127.0.0.1 (1 prefill + 1 decode worker, KV over NIXL, the default
model): answers equal the gRPC path's, SSE streaming, stop strings, usage, refusals in
OpenAI's error shape, and a disconnect that frees every block on both workers. Tests
that are refused or disconnect end with the leak probe (`leak_check`)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pdserve.v1 import common_pb2, gateway_pb2
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.conftest import MODEL_CACHE
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.prompts import long_prompt

# Pins (tests/integration/pins.py): the HTTP answers equal the gRPC answer to the same
# prompt, sent after it.
pytestmark = pytest.mark.pins(Pin.FLOAT32)

QUESTION = "What is the capital of France? Answer in one sentence."
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        ClusterConfig(
            gateway_port=0,
            num_prefill=1,
            num_decode=1,
            model_cache_dir=MODEL_CACHE,
            worker_kv_cache_bytes=96 << 20,
        )
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    assert cluster.http_address, "the gateway announced no HTTP address"
    # No retries: a refusal must surface as the client's typed error at once.
    return openai.OpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def model(cluster: LocalCluster) -> str:
    async def fetch() -> str:
        async with GatewayClient(cluster.gateway_address) as c:
            return (await c.list_models()).models[0].id

    return asyncio.run(fetch())


def _grpc(cluster: LocalCluster, **kwargs: object) -> tuple[str, gateway_pb2.GenerateResponse]:
    """The same request through gRPC Generate: (whole text, last message)."""

    prompt, messages = kwargs.pop("prompt", None), kwargs.pop("messages", None)
    request = build_request(prompt, RequestOptions(**kwargs), messages=messages)  # type: ignore[arg-type]

    async def collect() -> list[gateway_pb2.GenerateResponse]:
        async with GatewayClient(cluster.gateway_address) as c:
            return [m async for m in c.generate(request)]

    msgs = asyncio.run(collect())
    return "".join(m.text for m in msgs), msgs[-1]


def _workers(cluster: LocalCluster) -> gateway_pb2.ClusterStatusResponse:
    async def fetch() -> gateway_pb2.ClusterStatusResponse:
        async with GatewayClient(cluster.gateway_address) as c:
            return await c.cluster_status()

    return asyncio.run(fetch())


def _idle(cluster: LocalCluster, timeout: float) -> gateway_pb2.ClusterStatusResponse:
    """Poll until no worker holds a block or runs a request; returns the last status."""
    end = time.monotonic() + timeout
    while True:
        status = _workers(cluster)
        idle = all(w.used_blocks == 0 and w.held_blocks == 0 and w.running == 0
                   for w in status.workers)  # fmt: skip
        if (idle and status.active_streams == 0) or time.monotonic() > end:
            return status
        time.sleep(0.05)


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model]
    assert listed.data[0].owned_by == "pdserve"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_completion_equals_the_grpc_answer(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    text, last = _grpc(cluster, prompt=PROMPT, max_tokens=12)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == last.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == last.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    streamed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_streamed_and_whole_equal_the_grpc_answer_with_usage(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    text, last = _grpc(cluster, messages=[("user", QUESTION)], max_tokens=24)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=24,
        temperature=0,
        seed=7,
    )
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    # The last chunk carries only usage; the one before it the finish reason.
    *deltas, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == text
    reason = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
    assert deltas[-1].choices[0].finish_reason == reason[last.finish_reason]
    assert all(c.usage is None for c in deltas)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == last.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == last.usage.prompt_tokens


def test_stop_strings_cut_the_text_streamed_or_not(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    full, _ = _grpc(cluster, prompt=PROMPT, max_tokens=24)
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    expected = full[: full.index(stop)]
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop
    )
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=["@@@", stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"n": 17}, openai.BadRequestError, "n"),
        ({"temperature": 3.0}, openai.BadRequestError, "temperature"),
        ({"top_p": 0.0}, openai.BadRequestError, "top_p"),
        ({"max_tokens": 9000}, openai.BadRequestError, "max_tokens"),
        ({"model": "gpt-9"}, openai.NotFoundError, "model"),
    ],
)
def test_invalid_requests_are_refused_naming_the_parameter(
    cluster: LocalCluster,
    client: openai.OpenAI,
    model: str,
    kwargs: dict[str, object],
    error: type[openai.APIStatusError],
    param: str,
) -> None:
    probe = start_probe(cluster)
    settings: dict[str, object] = {"model": model, "prompt": "Hello", "max_tokens": 4}
    settings.update(kwargs)
    with pytest.raises(error) as info:
        client.completions.create(**settings)  # type: ignore[call-overload]
    assert info.value.param == param
    assert param in info.value.message
    # The server is still up and answering.
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices
    assert_cluster_clean(probe)


def test_chat_refusals_and_openai_error_shape(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    probe = start_probe(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=[cast(Any, {"role": "wizard", "content": "hi"})],
        )
    assert info.value.param == "messages" and "role" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0
        )
    assert info.value.param == "max_completion_tokens"
    # The raw body: OpenAI's shape exactly, for any client.
    base = f"http://{cluster.http_address}/v1"
    for path, body, status in [
        ("/completions", {"prompt": "hi", "n": 17}, 400),
        ("/completions", "{not json", 400),
        ("/nowhere", {}, 404),
    ]:
        data = body if isinstance(body, str) else json.dumps(body)
        req = urllib.request.Request(base + path, data=data.encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=30)
        assert http.value.code == status
        err = json.loads(http.value.read())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert_cluster_clean(probe)


def test_disconnect_mid_stream_frees_blocks_on_both_workers(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    assert _idle(cluster, timeout=5.0).active_streams == 0
    probe = start_probe(cluster)
    stream = client.completions.create(
        model=model, prompt=long_prompt(3), max_tokens=400, temperature=0, stream=True
    )
    for seen, chunk in enumerate(stream, 1):
        assert chunk.choices[0].finish_reason is None, "the request ended before the disconnect"
        if seen == 4:
            break
    busy = _workers(cluster)
    assert busy.active_streams == 1
    assert sum(w.used_blocks for w in busy.workers) > 0
    stream.close()
    start = time.monotonic()
    status = _idle(cluster, timeout=2.0)
    assert status.active_streams == 0, status
    assert all(w.used_blocks == 0 and w.held_blocks == 0 and w.running == 0
               for w in status.workers), status  # fmt: skip
    assert time.monotonic() - start < 2.0
    assert_cluster_clean(probe)
