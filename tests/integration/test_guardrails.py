"""Priority classes and the slow-client guardrail through real processes on 127.0.0.1.

One cluster (1 prefill + 1 decode, embedded Redis) runs with an API keys file (a tenant
with the default classes, a batch tenant whose default is sheddable) and a gateway told,
through its env vars (which the children inherit), to give up on a client after 2 s
without progress with 4 messages buffered. The class header is checked on the OpenAI
API (403 above the key's highest class, 400 for an unknown class) and on gRPC; a raw
HTTP client that stops reading mid-stream is disconnected while another request is
served, and so is a gRPC client with a small flow-control window, the cluster left clean
each time: every test ends with the leak probe (`leak_check`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from engine.model_store import DEFAULT_MODEL_NAME
from pdserve.v1 import common_pb2, gateway_pb2_grpc
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.gateway.openai.http_api import PRIORITY_HEADER
from tests.integration.keyed_cluster import keyed_cluster
from tests.integration.leak_check import assert_cluster_clean, start_probe

KEY = "tenant-a-key-000000000001"
KEY_BATCH = "batch-key-00000000000002"
GATEWAY_ENV = {"PDSERVE_SLOW_CLIENT_TIMEOUT_S": "2", "PDSERVE_STREAM_BUFFER_MESSAGES": "4"}
# A stream that must outlast the client's stall: greedy counting, and ignore_eos so that
# no dtype's rounding ends it early.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from keyed_cluster(
        tmp_path_factory, f"tenant-a {KEY}\nbatch {KEY_BATCH} class=sheddable\n", GATEWAY_ENV
    )


def _openai(cluster: LocalCluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key=key, max_retries=0, timeout=60
    )


def test_priority_header_above_the_key_is_403_unknown_is_400(cluster: LocalCluster) -> None:
    probe = start_probe(cluster)
    client = _openai(cluster, KEY)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2,
            extra_headers={PRIORITY_HEADER: "critical"},
        )  # fmt: skip
    assert "may ask for at most standard, not critical" in denied.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(
            model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2,
            extra_headers={PRIORITY_HEADER: "urgent"},
        )  # fmt: skip
    assert unknown.value.param == PRIORITY_HEADER
    assert "sheddable, standard, critical" in unknown.value.message
    # A batch key runs sheddable by default and may ask up to standard.
    reply = _openai(cluster, KEY_BATCH).completions.create(
        model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2,
        extra_headers={PRIORITY_HEADER: "standard"},
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    # The same check on gRPC: the request's priority field.
    with pytest.raises(grpc.aio.AioRpcError) as grpc_denied:
        asyncio.run(_grpc_complete(cluster, common_pb2.PRIORITY_CRITICAL))
    assert grpc_denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert_cluster_clean(probe)


async def _grpc_complete(cluster: LocalCluster, priority: int) -> None:
    async with GatewayClient(cluster.gateway_address, api_key=KEY) as client:
        request = build_request("Hi", RequestOptions(max_tokens=2))
        request.priority = priority  # type: ignore[assignment]
        await client.complete(request)


def _stalling_client(cluster: LocalCluster) -> socket.socket:
    """A streamed completion from a client with tiny receive buffers (small window and
    segments): once it stops reading, the gateway's writes back up within a few KiB."""
    host, port = cluster.http_address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect((host, int(port)))
    body = json.dumps({"model": DEFAULT_MODEL_NAME, "prompt": COUNTING, "max_tokens": 1500,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    sock.settimeout(60)
    seen = b""
    while b"data: " not in seen:  # the answer started: token 1 is on its way
        seen += sock.recv(1024)
    assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
    return sock


def _read_to_the_end(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything left on the connection, and whether it ended in a reset."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, True
    return data, False


def test_a_client_that_stops_reading_is_disconnected_and_leaves_nothing(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)
    sock = _stalling_client(cluster)
    start = time.monotonic()
    try:
        # The batch never waits for it: another request is served meanwhile.
        other = _openai(cluster, KEY).completions.create(
            model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0
        )
        assert other.usage is not None and other.usage.completion_tokens == 4
        # Given up on: its request is aborted on both workers, everything given back.
        while not asyncio.run(probe.read()).clean:
            assert time.monotonic() - start < 45, asyncio.run(probe.read())
            time.sleep(0.2)
        data, reset = _read_to_the_end(sock)
    finally:
        sock.close()
    # It reads again at once: it finds what was buffered, then the reason (or, past
    # the close grace, a reset connection); never a stream that just stops.
    assert reset or b"stopped reading" in data, data[-400:]
    assert b'finish_reason":"length' not in data  # it was cut short, not finished
    assert_cluster_clean(probe)


def test_a_grpc_client_that_stops_reading_gets_resource_exhausted(cluster: LocalCluster) -> None:
    """A gRPC client with a small flow-control window (no automatic window growth) stops
    reading after token 1: the gateway gives up on it and leaves the cluster clean; when
    it reads again it gets what was sent, then RESOURCE_EXHAUSTED saying why."""
    probe = start_probe(cluster)

    async def scenario() -> tuple[int, grpc.aio.AioRpcError]:
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        async with grpc.aio.insecure_channel(cluster.gateway_address, options=options) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            request = build_request(
                COUNTING, RequestOptions(max_tokens=1500, temperature=0, ignore_eos=True)
            )
            call = stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),))
            await call.read()
            start = time.monotonic()
            while not (await probe.read()).clean:
                assert time.monotonic() - start < 45, await probe.read()
                await asyncio.sleep(0.2)
            read = 0
            try:
                while await call.read() is not grpc.aio.EOF:
                    read += 1
            except grpc.aio.AioRpcError as exc:
                return read, exc
            raise AssertionError(f"the stream ended without an error after {read} messages")

    read, err = asyncio.run(scenario())
    assert read > 0  # what had been sent before the gateway gave up
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "stopped reading" in (err.details() or "")
    assert_cluster_clean(probe)
