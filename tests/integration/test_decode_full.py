"""A decode worker with no room for a request's KV after prefill, on real processes: the
request waits, or goes to another decode worker, and never fails after token 1.

Every worker's KV pool is small (`POOL_BLOCKS`), and the prompts are sized in whole
blocks so that the second request cannot fit on a decode worker while the first one
runs there, whatever the speed of the host:
- one decode worker: the second request's token 1 comes from prefill while the first
  request decodes; its KV waits (on the decode worker, then through the gateway's
  retries on the same worker) and it decodes once the first has finished;
- two decode workers: the second request shares the first one's routing key, so the
  router sends it to the same, full, worker; that worker refuses it
  (RESOURCE_EXHAUSTED, counted in its metrics) and the gateway moves the decode side to
  the other worker, which pulls the same KV from the prefill worker.
Each test ends with the leak probe: no block, lease, load lease or record left.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from engine.config import EngineConfig
from engine.kv_layout import KvLayout
from engine.model_spec import ModelSpec
from engine.model_store import prepare_default_model
from engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.conftest import MODEL_CACHE
from tests.integration.cluster_drills import named
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin

# Pins (tests/integration/pins.py): its pools are sized in float32 blocks and its second
# prompt's token 1 comes from the prefill worker.
pytestmark = pytest.mark.pins(Pin.FLOAT32, Pin.PREFILL_HOP)

BLOCK = 16  # tokens per KV block (the engine's default)
POOL_BLOCKS = 41  # every worker's KV pool: 656 tokens
LEASE_TTL_S = 120.0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(prepare_default_model(MODEL_CACHE, progress=False))


def _pool_bytes() -> int:
    cfg = EngineConfig(dtype="float32")  # as the suite pins its workers (conftest)
    spec = ModelSpec.from_dir(prepare_default_model(MODEL_CACHE, progress=False))
    layout = KvLayout.from_spec(spec, cfg.torch_dtype, BLOCK, cfg.torch_device)
    return POOL_BLOCKS * layout.bytes_per_block


def _cluster(num_decode: int) -> Iterator[LocalCluster]:
    # Admission control would hold the second request back until the decode pool had
    # room. It acts on signals a moment old, and several gateways admit at once, so a
    # decode worker can still be full when the KV comes: that moment is what is tested.
    # The waiting request's KV stays pinned on the prefill worker until the first
    # request has decoded: the lease must outlast that. At the default 30 s it did not
    # always on a 2-core float32 host (200 tokens took 28-33 s there). The gateway's
    # first-token timeout (60 s, across decode retries) is the next limit.
    cluster = LocalCluster(
        ClusterConfig(
            num_prefill=1, num_decode=num_decode, gateway_port=0, http_port=-1,
            model_cache_dir=MODEL_CACHE, worker_kv_cache_bytes=_pool_bytes(),
            gateway_args="--admission-control false", kv_lease_ttl_s=LEASE_TTL_S,
        )
    )  # fmt: skip
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def prompt_of(tokenizer: Tokenizer, head: str, tokens: int, word: str = " sea") -> str:
    """`head`, then `word` (one token) until the prompt is exactly `tokens` tokens."""
    text = head + word * (tokens - len(tokenizer.encode(head)))
    assert len(tokenizer.encode(text)) == tokens
    return text


def _head() -> str:
    return f"Ticket {uuid.uuid4().hex[:8]}: tell me about the"  # a fresh prefix each time


@dataclass
class Timed:
    """A Generate stream read to its end, with when (monotonic) each message came."""

    call: grpc.aio.UnaryStreamCall
    msgs: list[gateway_pb2.GenerateResponse] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)  # the first decode token
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""

    @classmethod
    def open(cls, client: GatewayClient, prompt: str, max_tokens: int) -> Timed:
        request = build_request(prompt, RequestOptions(max_tokens=max_tokens, ignore_eos=True))
        return cls(client.generate(request))

    async def read(self) -> Timed:
        try:
            while (msg := await self.call.read()) is not grpc.aio.EOF:
                assert isinstance(msg, gateway_pb2.GenerateResponse)
                self.msgs.append(msg)
                self.at.append(time.monotonic())
                if len(self.msgs) == 2:
                    self.first.set()
        except grpc.aio.AioRpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        except asyncio.CancelledError:
            if not self.call.cancelled():
                raise
            self.code = grpc.StatusCode.CANCELLED  # the test closed the stream itself
        return self

    @property
    def tokens(self) -> int:
        return sum(len(m.token_ids) for m in self.msgs)

    @property
    def decode_worker(self) -> str:
        return next(m.decode_worker for m in self.msgs if m.decode_worker)


# -- one decode worker: the request waits -------------------------------------------------


@pytest.fixture(scope="module")
def one_decode() -> Iterator[LocalCluster]:
    yield from _cluster(num_decode=1)


def test_one_full_decode_worker_the_request_waits_then_completes(
    one_decode: LocalCluster, tokenizer: Tokenizer
) -> None:
    # The first request holds >= 21 blocks once it decodes (20 of prompt); the second
    # needs 22 of the 20 left, so it cannot start before the first has finished.
    first_prompt = prompt_of(tokenizer, _head(), 20 * BLOCK)
    second_prompt = prompt_of(tokenizer, _head(), 22 * BLOCK)
    probe = start_probe(one_decode)

    async def scenario() -> tuple[Timed, Timed]:
        async with GatewayClient(one_decode.gateway_address) as client:
            first = Timed.open(client, first_prompt, 200)
            reading = asyncio.create_task(first.read())
            await asyncio.wait_for(first.first.wait(), 60)  # decoding, its KV in the pool
            second = await Timed.open(client, second_prompt, 8).read()
            return await reading, second

    first, second = asyncio.run(scenario())
    assert first.code == second.code == grpc.StatusCode.OK, (first.details, second.details)
    assert first.tokens == 200 and second.tokens == 8
    assert second.msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # Token 1 came while the first request still decoded; the second decoded after it.
    assert second.at[0] < first.at[-1] < second.at[1]
    assert_cluster_clean(probe)


# -- two decode workers, one full: the request goes to the other -------------------------


@pytest.fixture(scope="module")
def two_decode() -> Iterator[LocalCluster]:
    yield from _cluster(num_decode=2)


def _refused(cluster: LocalCluster, worker: str) -> float:
    """RESOURCE_EXHAUSTED answers the worker has given (its Prometheus counter)."""
    port = named(cluster, worker).metrics_port
    assert port is not None
    return sum(
        v
        for k, v in scrape(port).items()
        if k.startswith("pdserve_request_errors_total{") and "RESOURCE_EXHAUSTED" in k
    )


def test_one_full_decode_worker_of_two_the_request_goes_to_the_other(
    two_decode: LocalCluster, tokenizer: Tokenizer
) -> None:
    # The first request: 4 blocks of prompt (the routing key), decoding for long. The
    # second shares those 4 blocks (the same key: the router prefers the worker that
    # caches them) and needs 37 more, of the at most 36 that the first leaves free.
    first_prompt = prompt_of(tokenizer, _head(), 4 * BLOCK)
    second_prompt = prompt_of(tokenizer, first_prompt, POOL_BLOCKS * BLOCK - 8, " blue")
    shared = tokenizer.encode(second_prompt)[: 4 * BLOCK]
    assert shared == tokenizer.encode(first_prompt)
    probe = start_probe(two_decode)

    async def scenario() -> tuple[Timed, Timed, float]:
        async with GatewayClient(two_decode.gateway_address) as client:
            first = Timed.open(client, first_prompt, POOL_BLOCKS * BLOCK - 4 * BLOCK - 32)
            reading = asyncio.create_task(first.read())
            await asyncio.wait_for(first.first.wait(), 60)
            full = first.decode_worker
            refused = _refused(two_decode, full)
            second = await Timed.open(client, second_prompt, 4).read()
            refused = _refused(two_decode, full) - refused
            still_running = not reading.done()
            first.call.cancel()  # done with it: the cancel frees its blocks
            await reading
            assert still_running, "the first request ended before the second was placed"
            return first, second, refused

    first, second, refused = asyncio.run(scenario())
    assert second.code == grpc.StatusCode.OK, second.details
    assert second.tokens == 4
    assert second.decode_worker != first.decode_worker  # moved off the full worker...
    assert refused == 1  # ...which had refused it once
    assert second.msgs[0].prefill_worker == first.msgs[0].prefill_worker
    assert_cluster_clean(probe)
