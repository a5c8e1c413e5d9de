"""Bad input against a running cluster: hypothesis-generated requests to the gateway and
to the workers, protobuf bytes that do not parse, and junk on raw TCP connections.

Every answer must be one of the documented outcomes (RELIABILITY.md): a finished stream,
INVALID_ARGUMENT naming the field, NOT_FOUND (unknown model), RESOURCE_EXHAUSTED (KV pool
or stream cap), and for a worker's Decode with a forged KV handle also UNAVAILABLE (its
exporter address is dead). Never UNKNOWN, INTERNAL or a hang. After each group every
server still answers its health check SERVING and the leak probe (baseline taken before
the group's first case) finds nothing held and no lease ended by expiry. The case
counts are the constants below; outputs are capped at two tokens so the valid cases
stay short.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.reliability.leak_probe import LeakProbe, ProbeTarget
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.gateway.service import MAX_PROMPT_CHARS
from tests.integration.test_cluster import _cluster
from tests.integration.wire_bytes import JUNK, OWED_A_STATUS, field, flip, send_junk

# Runs beside one other pairable file in make test (tests/conftest.py).
pytestmark = pytest.mark.pairable

GATEWAY_CASES = 800  # typed GenerateRequests through the gateway
WIRE_CASES = 450  # raw bytes as a GenerateRequest (random, truncated, bad UTF-8)
PREFILL_CASES = 250  # typed PrefillRequests straight to the prefill worker
DECODE_CASES = 500  # DecodeRequests with forged KV handles straight to the decode worker
assert GATEWAY_CASES + WIRE_CASES + PREFILL_CASES + DECODE_CASES >= 2000

OK = grpc.StatusCode.OK
VOCAB_SIZE = 49152  # the default model's
GATEWAY_CODES = {OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.RESOURCE_EXHAUSTED}  # fmt: skip
# DATA_LOSS: a forged handle's block ids, in range, name blocks whose bytes fail the
# handle's checksums (before checksums, such a handle decoded another prompt's KV).
DECODE_CODES = GATEWAY_CODES | {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
CALL_TIMEOUT_S = 60.0  # a hang shows up as DEADLINE_EXCEEDED, which no test allows
T = TypeVar("T")
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Rig:
    """The cluster plus one event loop and client reused by every hypothesis example."""

    cluster: LocalCluster
    loop: asyncio.AbstractEventLoop
    client: GatewayClient
    raw: grpc.aio.Channel  # to the gateway, for requests sent as bytes
    model: str

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def worker(self, role: str) -> str:
        return next(c.address for c in self.cluster.children if c.name == f"{role}-0")


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    cluster = _cluster(num_prefill=1, num_decode=1, http_port=-1, kv_lease_ttl_s=5.0)
    loop = asyncio.new_event_loop()
    try:

        async def connect() -> Rig:
            client = GatewayClient(cluster.gateway_address)
            model = (await client.list_models()).models[0].id
            raw = grpc.aio.insecure_channel(cluster.gateway_address)
            return Rig(cluster, loop, client, raw, model)

        rig = loop.run_until_complete(connect())
        yield rig
        loop.run_until_complete(rig.client.close())
        loop.run_until_complete(rig.raw.close())
    finally:
        loop.close()
        cluster.stop()


@pytest.fixture
def probe(rig: Rig) -> LeakProbe:
    """The leak probe, its baseline taken before the test's first case."""
    return rig.run(LeakProbe.start(ProbeTarget.local(rig.cluster)))


def _assert_healthy_and_clean(rig: Rig, probe: LeakProbe) -> None:
    """Every server SERVING, a normal request still works, nothing held anywhere."""

    async def check() -> None:
        for child in rig.cluster.children:
            async with grpc.aio.insecure_channel(child.address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, child.name
        reply = await rig.client.complete(build_request("Hello", RequestOptions(max_tokens=2)))
        assert reply.finished
        leaks = await probe.wait_clean()
        assert leaks.clean, leaks

    rig.run(check())


# -- typed requests through the gateway ------------------------------------------------

# Any character but lone surrogates, which a str field cannot carry (bad UTF-8 reaches the
# gateway in the wire cases instead). Short: each character may be several tokens, and
# a valid prompt is prefilled on a CPU.
_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
_HUGE_TEXT = st.sampled_from(
    ["hi " * 9000, "x" * (MAX_PROMPT_CHARS + 1), "\u00e9" * 20000, "\u0000" * 5000]
)
_U32 = st.integers(0, 2**32 - 1)
_ANY_FLOAT = st.floats(width=32)  # nan, inf, denormals, huge, negative


@st.composite
def _mostly(draw: st.DrawFn, valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
    """Valid nine times in ten: a case with one bad field stops at it, so most fields of
    most cases must be valid for the deeper paths (prefill, sampling, decode) to run."""
    return draw(wild if draw(st.integers(0, 9)) == 9 else valid)


@st.composite
def _sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams(
        stop=draw(_mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                          st.lists(st.text(max_size=260), max_size=18))),
        stop_token_ids=draw(_mostly(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
                                    st.lists(_U32, max_size=6))),
        ignore_eos=draw(st.booleans()),
    )  # fmt: skip
    # Always set: at most 2 tokens when valid, 0 or past the context when not.
    sp.max_tokens = draw(
        _mostly(st.integers(1, 2), st.one_of(st.just(0), st.integers(8193, 2**32 - 1)))
    )
    temperature = _mostly(
        st.one_of(st.none(), st.floats(0, 2, width=32), st.floats(0, 2**-100, width=32)),
        _ANY_FLOAT,
    )
    top_p = _mostly(st.one_of(st.none(), st.floats(0, 1, exclude_min=True, width=32)), _ANY_FLOAT)
    top_k = _mostly(st.one_of(st.none(), st.integers(0, 100)), _U32)
    seed = st.one_of(st.none(), st.integers(0, 2**64 - 1))
    for name, strategy in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                           ("seed", seed)):  # fmt: skip
        value = draw(strategy)
        if value is not None:
            setattr(sp, name, value)
    return sp


@st.composite
def _generate_request(draw: st.DrawFn, model: str) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        model=draw(_mostly(st.sampled_from(["", model]), st.text(max_size=12))),
        sampling=draw(_sampling()),
        request_id=draw(st.one_of(st.just(""), st.text(max_size=40))),
        # The class: unset, each defined one, or any int32 (proto3 enums are open).
        priority=draw(_mostly(st.integers(0, 3), st.integers(-(2**31), 2**31 - 1))),
    )
    which = draw(st.integers(0, 19))  # prompt 60%, messages 25%, huge 5%, neither 10%
    if which < 12:
        req.prompt = draw(_mostly(_TEXT, st.just("")))
    elif which < 17:
        roles = _mostly(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8))
        pairs = draw(st.lists(st.tuples(roles, st.text(max_size=16)), max_size=4))
        req.messages.SetInParent()  # an empty list is still "messages"
        req.messages.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in pairs)
    elif which < 18:
        req.prompt = draw(_HUGE_TEXT)
    return req


async def _generate(
    client: GatewayClient, request: gateway_pb2.GenerateRequest
) -> tuple[grpc.StatusCode, str, list[gateway_pb2.GenerateResponse]]:
    msgs: list[gateway_pb2.GenerateResponse] = []
    try:
        async for msg in client.generate(request, timeout=CALL_TIMEOUT_S):
            msgs.append(msg)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", msgs
    return OK, "", msgs


def test_fuzzed_generate_requests_get_documented_statuses(rig: Rig, probe: LeakProbe) -> None:
    @settings(FUZZ, max_examples=GATEWAY_CASES)
    @given(request=_generate_request(rig.model))
    def case(request: gateway_pb2.GenerateRequest) -> None:
        code, details, msgs = rig.run(_generate(rig.client, request))
        assert code in GATEWAY_CODES, (code, details, request)
        if code == OK:
            assert msgs and msgs[-1].finished, request
            assert msgs[-1].usage.completion_tokens <= request.sampling.max_tokens
        elif code == grpc.StatusCode.INVALID_ARGUMENT:
            assert ": " in details, details  # "field: limit"

    case()
    _assert_healthy_and_clean(rig, probe)


# -- bytes that are not a valid request -------------------------------------------------


# max_tokens 1 first: a truncated copy keeps it (and stays short) while losing the rest.
_ONE_TOKEN = field(4, b"\x08\x01")  # sampling { max_tokens: 1 }
_VALID = [
    _ONE_TOKEN + field(2, b"Hello there"),
    _ONE_TOKEN + field(3, field(1, field(1, b"user") + field(2, b"Hi"))),  # messages
    _ONE_TOKEN + field(2, "caf\u00e9 \U0001f600".encode()) + field(5, b"my-id"),
]


# Not UTF-8: a lone surrogate, an overlong "/", a stray continuation byte, past U+10FFFF.
_BAD_UTF8 = [b"\xed\xa0\x80", b"\xc0\xaf", b"\x80", b"\xf4\x90\x80\x80", b"\xff\xfe"]
_WIRE = st.one_of(
    st.binary(max_size=256),  # noise
    st.sampled_from(_BAD_UTF8).map(lambda bad: _ONE_TOKEN + field(2, b"ok " + bad)),
    st.builds(lambda p: _ONE_TOKEN + field(2, p), st.binary(max_size=48)),  # prompt bytes
    st.builds(lambda b, n: b[:n], st.sampled_from(_VALID), st.integers(0, 60)),  # truncated
    st.builds(flip, st.sampled_from(_VALID), st.integers(0, 255), st.integers(0, 255)),
)


async def _raw_call(
    channel: grpc.aio.Channel, body: bytes, stream: bool
) -> tuple[grpc.StatusCode, str]:
    """Send `body` as the request bytes (no serializer) to Generate or Complete."""
    try:
        if stream:
            generate = channel.unary_stream("/pdserve.v1.Gateway/Generate")
            replies = [gateway_pb2.GenerateResponse.FromString(r)
                       async for r in generate(body, timeout=CALL_TIMEOUT_S)]  # fmt: skip
            assert replies and replies[-1].finished
        else:
            complete = channel.unary_unary("/pdserve.v1.Gateway/Complete")
            reply = await complete(body, timeout=CALL_TIMEOUT_S)
            assert gateway_pb2.GenerateResponse.FromString(reply).finished
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


def test_malformed_request_bytes_get_invalid_argument(rig: Rig, probe: LeakProbe) -> None:
    @settings(FUZZ, max_examples=WIRE_CASES)
    @given(body=_WIRE, stream=st.booleans())
    def case(body: bytes, stream: bool) -> None:
        code, details = rig.run(_raw_call(rig.raw, body, stream))
        assert code in GATEWAY_CODES, (code, details, body)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert ": " in details, details

    case()
    _assert_healthy_and_clean(rig, probe)


# -- workers called directly --------------------------------------------------------------

_TOKENS = _mostly(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24),
                  st.lists(_U32, max_size=24))  # fmt: skip


async def _prefill(
    address: str, request: worker_pb2.PrefillRequest
) -> tuple[grpc.StatusCode, str, worker_pb2.PrefillResponse | None]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            reply = await stub.Prefill(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", None
        # Played the gateway: drop the lease now rather than leave it to expire.
        await stub.Abort(worker_pb2.AbortRequest(request_id=request.request_id), timeout=10)
    return OK, "", reply


def test_fuzzed_prefill_calls_get_documented_statuses(rig: Rig, probe: LeakProbe) -> None:
    @settings(FUZZ, max_examples=PREFILL_CASES)
    @given(tokens=_TOKENS, sampling=_sampling(), salt=st.text(max_size=16),
           weight=st.floats(width=32))  # fmt: skip
    def case(
        tokens: list[int], sampling: common_pb2.SamplingParams, salt: str, weight: float
    ) -> None:
        request = worker_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=tokens, sampling=sampling,
            cache_salt=salt, cache_weight=weight,
        )  # fmt: skip
        code, details, reply = rig.run(_prefill(rig.worker("prefill"), request))
        assert code in GATEWAY_CODES - {grpc.StatusCode.NOT_FOUND}, (code, details, request)
        if weight != 0 and not 0 < weight < math.inf:  # 0 is unset: an even share
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, request)
        if reply is not None:
            assert reply.finished or len(reply.kv_handle.block_ids) > 0

    case()
    _assert_healthy_and_clean(rig, probe)


def _template(rig: Rig) -> tuple[list[int], common_pb2.KvHandle]:
    """A real handle to forge from; its own lease is dropped at once (Abort)."""
    prompt = list(range(1000, 1040))
    request = worker_pb2.PrefillRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )  # fmt: skip
    code, _, reply = rig.run(_prefill(rig.worker("prefill"), request))
    assert code == OK and reply is not None
    return prompt, reply.kv_handle


@st.composite
def _forged(
    draw: st.DrawFn, prompt: list[int], real: common_pb2.KvHandle
) -> tuple[list[int], common_pb2.KvHandle]:
    """A handle mostly like a real one, some fields replaced; no expiry, so it reaches
    the handshake and the read whenever the fields that are checked still agree."""
    tokens = draw(_mostly(st.just(prompt), _TOKENS))
    handle = common_pb2.KvHandle()
    handle.CopyFrom(real)
    handle.lease_expiry_unix_ms = 0
    handle.num_tokens = draw(_mostly(st.just(len(tokens)), _U32))
    blocks = -(-len(tokens) // 16)
    handle.block_ids[:] = draw(_mostly(
        st.lists(st.integers(0, 40), min_size=blocks, max_size=blocks),
        st.lists(st.one_of(_U32, st.integers(0, 200)), min_size=blocks, max_size=blocks + 1),
    ))  # fmt: skip
    for name, wild in (("protocol_version", _U32), ("first_token_id", _U32),
                       ("layout_fingerprint", st.text(max_size=16)),
                       ("backend", st.sampled_from(["", "tcp", "rdma"])),
                       ("incarnation", st.text(max_size=12)),
                       ("transfer_address", st.sampled_from(["", "127.0.0.1:1", "nowhere"])),
                       ("lease_id", st.text(max_size=12))):  # fmt: skip
        value = draw(_mostly(st.just(getattr(real, name)), wild))
        setattr(handle, name, value)
    return tokens, handle


async def _decode(address: str, request: worker_pb2.DecodeRequest) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            chunks = [c async for c in worker_pb2_grpc.WorkerStub(channel).Decode(
                request, timeout=CALL_TIMEOUT_S)]  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    assert chunks and chunks[-1].finished
    return OK, ""


def test_forged_kv_handles_get_documented_statuses(rig: Rig, probe: LeakProbe) -> None:
    prompt, real = _template(rig)

    # A moved stream's resume_token_ids: none mostly; else ids in or past the vocabulary,
    # as many as max_tokens or fewer, with the handle (the prompt's KV imported) or without
    # it (the decode worker prefills the prompt itself); either way it resumes after them,
    # and a resume it cannot honour is refused.
    resume = _mostly(
        st.just([]), st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), _U32), max_size=3)
    )

    @settings(FUZZ, max_examples=DECODE_CASES)
    @given(forged=_forged(prompt, real), max_tokens=st.integers(1, 2), resume=resume,
           keep_handle=_mostly(st.just(True), st.just(False)))  # fmt: skip
    def case(
        forged: tuple[list[int], common_pb2.KvHandle],
        max_tokens: int,
        resume: list[int],
        keep_handle: bool,
    ) -> None:
        tokens, handle = forged
        request = worker_pb2.DecodeRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=tokens,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens), resume_token_ids=resume,
        )  # fmt: skip
        if keep_handle:
            request.kv_handle.CopyFrom(handle)
        code, details = rig.run(_decode(rig.worker("decode"), request))
        assert code in DECODE_CODES, (code, details, request)
        if any(t >= VOCAB_SIZE for t in resume) or len(resume) >= max_tokens:
            assert code != OK, (code, request)  # never served past a bad resume

    case()
    _assert_healthy_and_clean(rig, probe)


# -- junk on the wire -------------------------------------------------------------------


def test_junk_on_raw_connections_leaves_every_server_up(rig: Rig, probe: LeakProbe) -> None:
    _, handle = _template(rig)
    targets = {c.name: c.address for c in rig.cluster.children}
    targets["kv-transfer"] = handle.transfer_address
    for name, address in targets.items():
        for kind, payload in JUNK.items():
            owed = kind in OWED_A_STATUS
            reply = send_junk(address, payload, half_close=not owed)
            # A call it can parse gets a status or a reset; anything else, once we stop
            # writing, an answer or a hang-up: never silence.
            assert reply.answered if owed else reply.ended, (name, kind, reply)
    _assert_healthy_and_clean(rig, probe)


def test_concurrent_requests_with_one_client_request_id_both_finish(
    rig: Rig, probe: LeakProbe
) -> None:
    """A client-chosen id is not trusted to be unique: the workers see distinct ids."""

    async def both() -> list[tuple[grpc.StatusCode, str, list[gateway_pb2.GenerateResponse]]]:
        request = build_request(
            "Count to ten:", RequestOptions(max_tokens=8, ignore_eos=True, request_id="same-id")
        )
        return list(await asyncio.gather(*(_generate(rig.client, request) for _ in range(3))))

    for code, details, msgs in rig.run(both()):
        assert code == OK, details
        assert msgs[-1].usage.completion_tokens == 8 and msgs[0].request_id == "same-id"
    _assert_healthy_and_clean(rig, probe)
