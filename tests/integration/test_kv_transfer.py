"""KV transfer between two real processes, over NIXL and over the TCP fallback.

The prefill peer is a separate process (`kv_peer.py`) with its own engine and exporter;
the decode side is this process's engine with a KvImporter. Decoded tokens must equal a
single-engine run, and every failure must leave no block behind on either side.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.engine import LLMEngine
from engine.finish_reason import FinishReason
from engine.priority import Priority
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from kvtransfer.backend import ReadResult
from kvtransfer.checksum import block_checksums
from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    InvalidHandleError,
    KvCorruptionError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerUnavailableError,
    TransferError,
)
from kvtransfer.fault import BitFlips
from kvtransfer.importer import KvImporter
from tests.conftest import EngineFactory, assert_no_leaks
from tests.integration.peer import PeerProcess
from tests.prompts import SHORT, long_prompt

BACKENDS = ["nixl", "tcp"]
PARAMS = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def reference(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=400)


@pytest.fixture(scope="module")
def decode(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=400)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def peer(backend: str) -> Iterator[PeerProcess]:
    p = PeerProcess(backend)
    yield p
    p.close()


@pytest.fixture
def importer(decode: LLMEngine, backend: str) -> Iterator[KvImporter]:
    imp = KvImporter(decode.handoff, TransferConfig(kv_backend=backend, kv_transfer_timeout_s=5))
    yield imp
    imp.close()


def _decode_all(engine: LLMEngine, request_id: str, first: int) -> list[int]:
    out = [first]
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == request_id:
                out += o.new_token_ids
    return out


def _prompts(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(SHORT[0]), tok.encode(long_prompt(1)), tok.encode(long_prompt(6)),
            tok.encode(long_prompt(20))]  # fmt: skip


def test_transfer_then_decode_matches_single_engine(
    peer: PeerProcess, importer: KvImporter, decode: LLMEngine, reference: LLMEngine
) -> None:
    prompts = _prompts(reference)
    assert max(len(p) for p in prompts) >= 2000
    for i, prompt in enumerate(prompts):
        (expected,) = reference.generate([prompt], PARAMS)
        handle = peer.prefill(prompt)
        assert handle.first_token_id == expected[0]
        result = importer.import_kv(handle, RequestSpec(prompt, PARAMS, request_id=f"r{i}"))
        # Prompts share leading sections, so later ones find blocks in the local cache.
        assert result.num_cached_blocks + result.num_read_blocks == len(handle.block_ids)
        assert result.bytes == result.num_read_blocks * decode.layout.bytes_per_block
        assert _decode_all(decode, f"r{i}", handle.first_token_id) == expected
    stats = peer.wait_stats(lambda s: s["held_blocks"] == 0)
    assert stats["held_blocks"] == 0 and stats["active_leases"] == 0
    assert stats["released"] >= len(prompts)
    assert_no_leaks(decode)
    decode.pool.reset_prefix_cache()


@pytest.fixture(scope="module")
def int8_decode(make_engine: EngineFactory) -> tuple[LLMEngine, list[int], list[int]]:
    """An int8-cache decode engine, a prompt whose last block is partial, and what one
    int8 engine generates for it."""
    reference = make_engine(num_kv_blocks=200, kv_cache_dtype="int8")
    prompt = reference.tokenizer.encode(long_prompt(4))
    assert len(prompt) % reference.config.block_size != 0  # the partial block keeps growing
    (expected,) = reference.generate([prompt], PARAMS)
    return make_engine(num_kv_blocks=200, kv_cache_dtype="int8"), prompt, expected


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_an_8bit_cache_moves_with_its_scales(
    int8_decode: tuple[LLMEngine, list[int], list[int]], backend_name: str
) -> None:
    """int8 KV from another process, over each backend: the blocks' in-block scales come
    along, and decoding on them gives what one int8 engine gives."""
    decode, prompt, expected = int8_decode
    peer = PeerProcess(backend_name, kv_cache_dtype="int8")
    imp = KvImporter(
        decode.handoff, TransferConfig(kv_backend=backend_name, kv_transfer_timeout_s=5)
    )
    try:
        handle = peer.prefill(prompt)
        assert handle.first_token_id == expected[0]
        result = imp.import_kv(handle, RequestSpec(prompt, PARAMS, request_id=f"q8-{backend_name}"))
        assert decode.layout.dtype == "int8" and result.num_read_blocks == len(handle.block_ids)
        assert result.bytes == result.num_read_blocks * decode.layout.bytes_per_block
        assert _decode_all(decode, f"q8-{backend_name}", handle.first_token_id) == expected
        assert peer.wait_stats(lambda s: s["held_blocks"] == 0)["held_blocks"] == 0
    finally:
        imp.close()
        peer.close()
    assert_no_leaks(decode)
    decode.pool.reset_prefix_cache()  # the next backend reads every block again


def test_prefix_aware_import_reads_only_missing_blocks(
    peer: PeerProcess, importer: KvImporter, decode: LLMEngine
) -> None:
    prompt = decode.tokenizer.encode(long_prompt(5))
    bs = decode.config.block_size
    first = importer.import_kv(peer.prefill(prompt), RequestSpec(prompt, PARAMS, request_id="p1"))
    assert first.num_cached_blocks == 0
    _decode_all(decode, "p1", 0)
    second = importer.import_kv(peer.prefill(prompt), RequestSpec(prompt, PARAMS, request_id="p2"))
    assert second.num_cached_blocks == len(prompt) // bs
    assert second.num_read_blocks == (1 if len(prompt) % bs else 0)
    _decode_all(decode, "p2", 0)
    assert peer.wait_stats(lambda s: s["held_blocks"] == 0)["held_blocks"] == 0
    assert_no_leaks(decode)
    decode.pool.reset_prefix_cache()


@pytest.mark.parametrize(
    ("max_tokens", "reason"), [(1, FinishReason.LENGTH), (4, FinishReason.STOP)]
)
def test_import_ended_by_its_first_token_reports_why(
    peer: PeerProcess,
    importer: KvImporter,
    decode: LLMEngine,
    max_tokens: int,
    reason: FinishReason,
) -> None:
    """max_tokens 1 ends on LENGTH, an EOS first token on STOP; nothing is queued."""
    prompt = decode.tokenizer.encode(SHORT[1])
    handle = peer.prefill(prompt)
    if reason is FinishReason.STOP:
        handle.first_token_id = min(decode.stop_checker.eos_token_ids)
    params = SamplingParams(max_tokens=max_tokens)
    result = importer.import_kv(handle, RequestSpec(prompt, params, request_id="ended"))
    assert result.finish_reason is reason and not result.queued
    assert not decode.has_unfinished()
    assert peer.wait_stats(lambda s: s["held_blocks"] == 0)["held_blocks"] == 0
    assert_no_leaks(decode)
    decode.pool.reset_prefix_cache()


def test_import_keeps_the_requests_class_and_deadline(
    peer: PeerProcess, importer: KvImporter, decode: LLMEngine
) -> None:
    prompt = decode.tokenizer.encode(long_prompt(1))
    handle = peer.prefill(prompt)
    deadline = time.monotonic() + 600
    importer.import_kv(
        handle,
        RequestSpec(
            prompt, PARAMS, request_id="classed", priority=Priority.CRITICAL, deadline=deadline
        ),
    )
    landed = decode.requests["classed"]
    assert (landed.priority, landed.deadline) == (Priority.CRITICAL, deadline)
    _decode_all(decode, "classed", handle.first_token_id)
    assert peer.wait_stats(lambda s: s["held_blocks"] == 0)["held_blocks"] == 0
    assert_no_leaks(decode)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("protocol_version", 99, InvalidHandleError),
        ("layout_fingerprint", "0123456789abcdef", LayoutMismatchError),
        ("num_tokens", 3, InvalidHandleError),
        ("lease_id", "", InvalidHandleError),
    ],
)
def test_corrupt_handle_is_invalid_argument(
    peer: PeerProcess,
    importer: KvImporter,
    decode: LLMEngine,
    field: str,
    value: object,
    error: type[TransferError],
) -> None:
    expired = peer.stats()["expired"]
    prompt = decode.tokenizer.encode(long_prompt(1))
    handle = peer.prefill(prompt)
    lease_id = handle.lease_id
    setattr(handle, field, value)
    with pytest.raises(error) as info:
        importer.import_kv(handle, RequestSpec(prompt, PARAMS, request_id="bad"))
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert field in str(info.value)
    assert_no_leaks(decode)
    # The refused import never read the blocks, so the lease is still out: the gateway's
    # Abort gives it back; here the test does. Left alone it would expire, which
    # `assert_clean` counts as a leak.
    assert peer.release(lease_id)
    peer.assert_clean(expired)


def test_a_handle_without_checksums_is_refused(
    peer: PeerProcess, importer: KvImporter, decode: LLMEngine
) -> None:
    """An exporter with kv_checksum off sends none; a verifying importer says so."""
    expired = peer.stats()["expired"]
    prompt = decode.tokenizer.encode(SHORT[0])
    handle = peer.prefill(prompt)
    del handle.block_checksums[:]
    with pytest.raises(InvalidHandleError, match=r"block_checksums: 0 checksums .*kv_checksum off"):
        importer.import_kv(handle, RequestSpec(prompt, PARAMS, request_id="unchecked"))
    assert_no_leaks(decode)
    assert peer.release(handle.lease_id)
    peer.assert_clean(expired)


#: Imports with bits flipped in transit, per backend (the TCP fallback is 20x slower),
#: prefilled in batches of FLIP_BATCH.
FLIPPED_IMPORTS = {"nixl": 240, "tcp": 80}
FLIP_BATCH = 40


def _random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Distinct prompts of 1 or 2 blocks, so no import finds its blocks cached."""
    return [[rng.randrange(100, 40_000) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def test_every_bit_flipped_in_transit_is_caught(
    backend: str, peer: PeerProcess, decode: LLMEngine, reference: LLMEngine
) -> None:
    """One bit of one block flipped on every third read (re-reads count): each import
    whose first read was hit finds it by checksum, re-reads that block and commits the
    exporter's exact bytes; the flips detected equal the flips made, and a sample of the
    repaired requests decode as a single engine does."""
    expired = peer.stats()["expired"]
    flips = BitFlips(every=3, seed=11)
    config = TransferConfig(kv_backend=backend, kv_transfer_timeout_s=5)
    imp = KvImporter(decode.handoff, config, flips=flips)
    rng = random.Random(5)
    detected = decoded = 0
    try:
        for n in range(FLIPPED_IMPORTS[backend] // FLIP_BATCH):
            prompts = _random_prompts(rng, FLIP_BATCH)
            handles = peer.prefill_many(prompts)
            for i, (prompt, handle) in enumerate(zip(prompts, handles, strict=True)):
                rid = f"flip{n}-{i}"
                made = flips.flipped
                result = imp.import_kv(handle, RequestSpec(prompt, PARAMS, request_id=rid))
                assert result.checksum_mismatches == flips.flipped - made, rid
                detected += result.checksum_mismatches
                landed = decode.requests[rid].block_ids[: len(handle.block_ids)]
                sums = block_checksums(decode.handoff.kv_blocks, landed)
                assert sums == list(handle.block_checksums), rid
                if result.checksum_mismatches and decoded < 3:
                    (expected,) = reference.generate([prompt], PARAMS)
                    assert _decode_all(decode, rid, handle.first_token_id) == expected, rid
                    decoded += 1
                    continue
                decode.abort(rid)
                while decode.has_unfinished():
                    decode.step()
    finally:
        imp.close()
    assert flips.flipped >= FLIPPED_IMPORTS[backend] // 4 and decoded == 3
    assert detected == flips.flipped
    assert_no_leaks(decode)
    decode.pool.reset_prefix_cache()
    peer.assert_clean(expired)


def test_kv_that_fails_its_checksum_twice_is_refused_and_given_back(
    backend: str, peer: PeerProcess, decode: LLMEngine
) -> None:
    """Every read corrupted: the re-read fails too, the import raises DATA_LOSS, its
    reservation is freed and the exporter's lease released, not left to expire."""
    expired = peer.stats()["expired"]
    released = peer.stats()["released"]
    config = TransferConfig(kv_backend=backend, kv_transfer_timeout_s=5)
    imp = KvImporter(decode.handoff, config, flips=BitFlips(every=1))
    try:
        for i in range(3):
            prompt = decode.tokenizer.encode(long_prompt(2 + i))
            with pytest.raises(KvCorruptionError, match="after a re-read") as info:
                imp.import_kv(peer.prefill(prompt), RequestSpec(prompt, PARAMS, request_id="bad"))
            assert info.value.code.name == "DATA_LOSS"
            assert_no_leaks(decode)
    finally:
        imp.close()
    assert peer.wait_stats(lambda s: s["released"] == released + 3)["active_leases"] == 0
    peer.assert_clean(expired)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unclaimed_lease_expires_and_unpins(backend: str) -> None:
    p = PeerProcess(backend, lease_ttl=1.0)
    try:
        p.prefill(list(range(100, 400)))
        assert p.stats()["held_blocks"] > 0
        stats = p.wait_stats(lambda s: s["expired"] == 1, timeout=5)
        assert stats["expired"] == 1 and stats["held_blocks"] == 0 and stats["used_blocks"] == 0
    finally:
        p.close()


def test_a_lease_that_expires_mid_read_discards_the_bytes(backend: str, decode: LLMEngine) -> None:
    """A one-sided read cannot be checked by the exporter: the importer learns from the
    release's answer whether the lease held for the whole read. Here the read outlasts
    the lease (it expires and the exporter unpins the blocks, free for reuse), so the
    import must fail with LeaseExpiredError and commit nothing, whatever the bytes."""
    p = PeerProcess(backend, lease_ttl=1.0)
    imp = KvImporter(decode.handoff, TransferConfig(kv_backend=backend, kv_transfer_timeout_s=10))
    real_read = imp.backend.read
    read_blocks = 0

    def slow_read(
        peer_key: str, handle: Any, src_blocks: list[int], dst_blocks: list[int], deadline: float
    ) -> ReadResult:
        nonlocal read_blocks
        done = real_read(peer_key, handle, src_blocks, dst_blocks, deadline)
        read_blocks += len(src_blocks)
        if read_blocks == len(handle.block_ids):  # the import's last chunk is in
            time.sleep(1.5)  # past the lease's TTL: the exporter's housekeeping ends it
        return done

    imp.backend.read = slow_read  # type: ignore[method-assign]
    decode.pool.reset_prefix_cache()  # every block is read: none is found here
    try:
        prompt = decode.tokenizer.encode(long_prompt(2))
        handle = p.prefill(prompt)
        with pytest.raises(LeaseExpiredError, match="ended during the read") as info:
            imp.import_kv(handle, RequestSpec(prompt, PARAMS, request_id="late"))
        assert info.value.code.name == "NOT_FOUND"
        assert "late" not in decode.requests
        assert_no_leaks(decode)
        stats = p.wait_stats(lambda s: s["expired"] == 1)
        assert stats["held_blocks"] == 0 and stats["active_leases"] == 0
        # A read that beats the lease is committed as before.
        imp.backend.read = real_read  # type: ignore[method-assign]
        handle = p.prefill(prompt)
        result = imp.import_kv(handle, RequestSpec(prompt, PARAMS, request_id="on-time"))
        assert result.queued and result.num_read_blocks > 0
        assert result.num_cached_blocks + result.num_read_blocks == len(handle.block_ids)
        _decode_all(decode, "on-time", handle.first_token_id)
        assert_no_leaks(decode)
    finally:
        imp.close()
        p.close()
        decode.pool.reset_prefix_cache()


def test_dead_exporter_gives_typed_error_within_deadline(backend: str, decode: LLMEngine) -> None:
    p = PeerProcess(backend)
    imp = KvImporter(decode.handoff, TransferConfig(kv_backend=backend, kv_transfer_timeout_s=2))
    try:
        prompt = decode.tokenizer.encode(long_prompt(2))
        handle = p.prefill(prompt)
        p.kill()
        start = time.monotonic()
        with pytest.raises((PeerUnavailableError, LeaseExpiredError)) as info:
            imp.import_kv(handle, RequestSpec(prompt, PARAMS, request_id="dead"))
        assert time.monotonic() - start < 2.5
        assert info.value.code.name in ("UNAVAILABLE", "NOT_FOUND")
        assert_no_leaks(decode)
    finally:
        imp.close()
        p.close()


def test_restarted_exporter_is_re_handshaken(backend: str, decode: LLMEngine) -> None:
    port = _free_port()
    imp = KvImporter(decode.handoff, TransferConfig(kv_backend=backend, kv_transfer_timeout_s=5))
    prompt = decode.tokenizer.encode(long_prompt(2))
    first = PeerProcess(backend, port=port)
    try:
        stale = first.prefill(prompt)
        imp.import_kv(stale, RequestSpec(prompt, PARAMS, request_id="before"))
        _decode_all(decode, "before", 0)
        stale = first.prefill(prompt)
    finally:
        first.close()
    second = PeerProcess(backend, port=port)
    try:
        assert second.incarnation != first.incarnation
        # The old incarnation's blocks are gone: a typed error, never stale data.
        with pytest.raises((LeaseExpiredError, PeerUnavailableError)):
            imp.import_kv(stale, RequestSpec(prompt, PARAMS, request_id="stale"))
        assert_no_leaks(decode)
        decode.pool.reset_prefix_cache()
        fresh = second.prefill(prompt)
        result = imp.import_kv(fresh, RequestSpec(prompt, PARAMS, request_id="after"))
        assert result.num_read_blocks == len(fresh.block_ids)
        assert imp.handshakes == 2
        _decode_all(decode, "after", 0)
        second.assert_clean(expired_before=0)
        assert_no_leaks(decode)
    finally:
        imp.close()
        second.close()
        decode.pool.reset_prefix_cache()


def test_a_peer_forgotten_mid_import_is_unavailable_not_a_nixl_error(
    decode: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two imports from one exporter: the first one's failed read forgets the peer (its
    exporter died) while the second has already looked it up. NIXL then refuses the
    released descriptors (NIXL_ERR_INVALID_PARAM); the importer must see the same typed
    error as for a dead peer (UNAVAILABLE: the gateway has the decode worker compute
    the KV), not an internal error, and leave nothing reserved."""
    p = PeerProcess("nixl")
    imp = KvImporter(decode.handoff, TransferConfig(kv_backend="nixl", kv_transfer_timeout_s=5))
    try:
        prompt = decode.tokenizer.encode(long_prompt(2))
        imp.import_kv(p.prefill(prompt), RequestSpec(prompt, PARAMS, request_id="first"))
        _decode_all(decode, "first", 0)
        handle = p.prefill(prompt)
        decode.pool.reset_prefix_cache()  # so the second import reads every block
        (key,) = imp.backend._peers  # type: ignore[attr-defined]
        stale = imp.backend._peer(key)  # type: ignore[attr-defined]
        imp.backend.forget(key)  # what the other import's failure does
        monkeypatch.setattr(imp.backend, "_peer", lambda _key: stale)
        with pytest.raises(PeerUnavailableError, match="could not start"):
            imp.import_kv(handle, RequestSpec(prompt, PARAMS, request_id="second"))
        assert_no_leaks(decode)
    finally:
        monkeypatch.undo()
        imp.close()
        p.close()
        decode.pool.reset_prefix_cache()
