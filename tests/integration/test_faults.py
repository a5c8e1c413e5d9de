"""Fault injection on real processes: workers killed (-9) or frozen (SIGSTOP) mid-request,
a prefill worker restarted on its old ports, Redis restarted, a router replica killed.

One module-scoped cluster (2 prefill + 2 decode workers, Redis placement) runs with short
deadlines and leases so that every bound fires within seconds. Each test injects one
fault and checks that (1) the client sees the documented typed outcome within the stated
bound, (2) requests the fault does not touch complete, and (3) after recovery the leak
probe (`leak_check`, baseline taken when the test starts) finds nothing held: no block,
request or KV lease on a worker, no load lease in Redis, nothing in a gateway request
record, and no lease ended by expiry unless the test says that one must. A test that
kills a worker brings it back before it ends, so the next one starts from a whole
cluster. RELIABILITY.md states the same bounds as the constants below.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import grpc
import pytest
import redis

from loadtest.reliability.leak_probe import LeakProbe, LeaseTtls, ProbeTarget
from pdserve.v1 import (
    gateway_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.cluster.local_cluster import Child, LocalCluster
from services.common.metrics import scrape
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.embedded_redis import EmbeddedRedis
from services.router.keyspace import Keyspace
from services.router.load import LoadLedger
from services.router.redis_client import connect
from services.router.registry import Registry, WorkerInfo
from tests.integration.cluster_drills import (
    Stream,
    busy_prefill,
    home_roles,
    kill,
    kv_transfer_port,
    named,
    pool,
    reachable,
    registered,
    restart_on_same_ports,
    serve,
)
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster, _collect
from tests.integration.test_router_service import _start_router
from tests.integration.usage_check import assert_ledger_matches
from tests.prompts import long_prompt

# Pins (tests/integration/pins.py): migrated streams equal uninterrupted ones token for
# token; the drills need short prompts over the hop and pools by start role.
pytestmark = pytest.mark.pins(Pin.FLOAT32, Pin.PREFILL_HOP, Pin.FIXED_ROLES)

HEARTBEAT_TTL_S = 4.0  # a dead or frozen worker leaves the registry within this
FIRST_TOKEN_TIMEOUT_S = 4.0  # gateway: decode start -> first decode token
TOKEN_TIMEOUT_S = 3.0  # gateway: longest gap between two tokens
KV_LEASE_TTL_S = 5.0  # prefill: un-pulled KV is unpinned after this
FAIL_FAST_S = 2.0  # a peer's death reaches the client within this
MEMBERSHIP_REFRESH_S = 1.0  # the gateway's router re-reads the registry this often
SLACK_S = 2.0  # scheduling noise on a loaded 2-core host
# A moved stream's longest pause: the survivor recomputes the moved streams' prompts and
# tokens so far, all at once, on a loaded 2-core host.
MOVE_GAP_S = 10.0

Ends = list[tuple[str, grpc.StatusCode, float]]  # per stream: decode worker, status, seconds


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = _cluster(
        num_prefill=2, num_decode=2, http_port=-1, heartbeat_ttl_s=HEARTBEAT_TTL_S,
        first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S, token_timeout_s=TOKEN_TIMEOUT_S,
        kv_lease_ttl_s=KV_LEASE_TTL_S,
    )  # fmt: skip
    try:
        yield c
    finally:
        for child in c.children:  # a failed test may have left a worker frozen
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.proc.pid, signal.SIGCONT)
        c.stop()


# -- helpers --------------------------------------------------------------------------


def _prompt(tag: str) -> str:
    return f"Fault drill {tag}: name one fact about the sea, in one sentence."


def _unique_long_prompt() -> str:
    # A fresh opening: no prefix-cache hit anywhere, so prefill takes a while on CPU.
    # About 1,800 tokens: what the test cluster's 96 MiB KV pools (2,176 tokens) fit.
    return f"Ticket {uuid.uuid4().hex}. " + long_prompt(15)


def _wait_registry(
    cluster: LocalCluster, present: set[str], absent: frozenset[str] = frozenset()
) -> None:
    end = time.monotonic() + HEARTBEAT_TTL_S + SLACK_S
    while True:
        ids = registered(cluster)
        if present <= ids and not absent & ids:
            return
        assert time.monotonic() < end, f"registry {ids}: want {present}, not {absent}"
        time.sleep(0.1)


def _wait_kv_leases_ended(probe: LeakProbe) -> None:
    """Until no worker holds a KV lease: one left un-pulled ends by expiry, within the TTL."""
    end = time.monotonic() + KV_LEASE_TTL_S + SLACK_S
    while any("active_leases" in held for held in asyncio.run(probe.read()).workers.values()):
        assert time.monotonic() < end, "a KV lease outlived its TTL"
        time.sleep(0.2)


# -- workers killed or frozen ---------------------------------------------------------


MOVE_GREEDY = 20  # concurrent greedy streams when a decode worker dies under them
MOVE_SEEDED = 4  # and seeded sampled ones
MOVE_TOKENS = 32


async def _open_streams(client: GatewayClient, tag: str, greedy: int, seeded: int) -> list[Stream]:
    """Streams opened together, each once its first decode chunk came; prompts depend
    on `tag` and the stream's index only, so two calls with one tag ask the same."""
    specs = [(f"{tag}{i}", None) for i in range(greedy)]
    specs += [(f"{tag}s{i}", 100 + i) for i in range(seeded)]
    opening = [Stream.open(client, _prompt(n), MOVE_TOKENS, seed=seed) for n, seed in specs]
    return list(await asyncio.gather(*opening))


async def _uninterrupted(client: GatewayClient, tag: str, greedy: int, seeded: int) -> list[Stream]:
    streams = await _open_streams(client, tag, greedy, seeded)
    ends = await asyncio.gather(*(s.finish() for s in streams))
    assert [code for code, _ in ends] == [grpc.StatusCode.OK] * len(streams)
    return streams


def _assert_moved_exactly(
    streams: list[Stream], reference: list[Stream], ends: list[tuple[grpc.StatusCode, float]],
    victim: str, since: float,
) -> list[float]:  # fmt: skip
    """Every stream ended OK with the tokens and text of the uninterrupted run; those on
    `victim` moved to another decode worker. Returns the moved streams' longest gaps."""
    assert [code for code, _ in ends] == [grpc.StatusCode.OK] * len(streams)
    assert [s.tokens for s in streams] == [r.tokens for r in reference]
    assert [s.text for s in streams] == [r.text for r in reference]
    moved = [s for s in streams if s.decode_workers[0] == victim]
    assert moved, "no stream was on the victim"
    for s in moved:
        assert len(s.decode_workers) == 2 and s.decode_workers[1] != victim, s.decode_workers
    return sorted(s.longest_gap_after(since) for s in moved)


def test_kill9_decode_mid_stream_moves_its_streams(cluster: LocalCluster) -> None:
    """The issue's drill: kill -9 the decode worker of 20 concurrent greedy streams (and
    4 seeded ones) mid-way; every stream completes, token-identical to a run without the
    kill, each moved one with its prompt's KV imported from the prefill worker, the gap
    is reported, and nothing leaks."""
    probe = start_probe(cluster)
    imported_before = _moves_with_imported_kv(cluster)

    async def scenario() -> tuple[list[Stream], list[Stream], str, float, list[Any]]:
        async with GatewayClient(cluster.gateway_address) as client:
            reference = await _uninterrupted(client, "kd", MOVE_GREEDY, MOVE_SEEDED)
            streams = await _open_streams(client, "kd", MOVE_GREEDY, MOVE_SEEDED)
            victim = streams[0].decode_worker
            killed = kill(named(cluster, victim))
            ends = await asyncio.gather(*(s.finish() for s in streams))
        return reference, streams, victim, killed, list(ends)

    reference, streams, victim, killed, ends = asyncio.run(scenario())
    try:
        gaps = _assert_moved_exactly(streams, reference, ends, victim, killed)
        print(f"moved {len(gaps)} streams: gap p50 {gaps[len(gaps) // 2]:.2f}s max {gaps[-1]:.2f}s")
        assert gaps[-1] < MOVE_GAP_S
        # The prefill worker exported each moved stream's prompt again (from its prefix
        # cache); the new decode worker imported it and computed only the tokens so far.
        assert _moves_with_imported_kv(cluster) - imported_before == len(gaps)
        # A moved stream is billed once, for the tokens its client got.
        assert_ledger_matches(cluster, [s.msgs[-1] for s in streams])
        # Its registration lapses; from then on new requests avoid it.
        _wait_registry(cluster, present=set(), absent=frozenset({victim}))
        pairs = asyncio.run(serve(cluster, 3, "kd-after"))
        assert all(decode != victim for _, decode in pairs)
    finally:
        cluster.relaunch(victim)
        _wait_registry(cluster, present={victim})
    assert_cluster_clean(probe)


ROLE_CHANGE_STREAMS = 6  # greedy streams on the cluster when a worker dies changing role


async def _set_role(address: str, role: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await worker_pb2_grpc.WorkerStub(channel).SetRole(
            worker_pb2.SetRoleRequest(role=role)
        )
    return reply.previous


def test_kill9_decode_worker_during_its_role_change_moves_its_streams(
    cluster: LocalCluster,
) -> None:
    """A decode worker killed while it changes its home role to prefill (its KV exporter
    starting, its registration moving) is a crash like any other: its streams move and
    end token-identical, its registration lapses from whichever pool it was in, it
    rejoins when restarted, and nothing leaks. An unknown role is refused, naming it."""
    probe = start_probe(cluster)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_set_role(pool(cluster, "decode")[0].address, "leader"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "SetRole.role" in str(refused.value.details()) and "leader" in str(
        refused.value.details()
    )

    async def scenario() -> tuple[list[Stream], list[Stream], str, float, list[Any]]:
        async with GatewayClient(cluster.gateway_address) as client:
            reference = await _uninterrupted(client, "rc", ROLE_CHANGE_STREAMS, 0)
            streams = await _open_streams(client, "rc", ROLE_CHANGE_STREAMS, 0)
            victim = streams[0].decode_worker
            change = asyncio.create_task(_set_role(named(cluster, victim).address, "prefill"))
            await asyncio.sleep(0.02)  # the call is in: the exporter is starting
            killed = kill(named(cluster, victim))
            with contextlib.suppress(grpc.aio.AioRpcError):
                await change
            ends = await asyncio.gather(*(s.finish() for s in streams))
        return reference, streams, victim, killed, list(ends)

    reference, streams, victim, killed, ends = asyncio.run(scenario())
    try:
        _assert_moved_exactly(streams, reference, ends, victim, killed)
        _wait_registry(cluster, present=set(), absent=frozenset({victim}))
    finally:
        cluster.relaunch(victim)
        _wait_registry(cluster, present={victim})
    assert home_roles(cluster)[victim] == "decode"  # restarted in the role it was given
    assert_cluster_clean(probe)


def _moves_with_imported_kv(cluster: LocalCluster) -> float:
    port = cluster.gateways[0].metrics_port
    assert port is not None
    return scrape(port).get("pdserve_stream_migration_prompt_kv_total{source=imported}", 0.0)


def test_sigstop_decode_moves_streams_once_the_token_deadline_fires(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)
    frozen: list[Child] = []

    def freeze(name: str) -> float:
        frozen.append(named(cluster, name))
        os.kill(frozen[-1].proc.pid, signal.SIGSTOP)
        return time.monotonic()

    async def scenario() -> tuple[Any, ...]:
        async with GatewayClient(cluster.gateway_address) as client:
            reference = await _uninterrupted(client, "ss", 4, 2)
            streams = await _open_streams(client, "ss", 4, 2)
            victim = streams[0].decode_worker
            stopped = freeze(victim)
            ends = await asyncio.gather(*(s.finish() for s in streams))
            # Both decode workers frozen: token 1 still comes from prefill, then the
            # decode call misses its first-token deadline, the stream moves once, and
            # the second worker misses it too: the move limit (1) ends it.
            freeze(next(c.name for c in pool(cluster, "decode") if c.name != victim))
            late = await Stream.open(client, _prompt("ss-late"), 40, first=1)
            first_token = time.monotonic()
            code, ended = await late.finish()
        return reference, streams, victim, stopped, list(ends), (code, ended - first_token)

    try:
        reference, streams, victim, stopped, ends, (late_code, late_wait) = asyncio.run(scenario())
    finally:
        for child in frozen:
            os.kill(child.proc.pid, signal.SIGCONT)
    gaps = _assert_moved_exactly(streams, reference, ends, victim, stopped)
    assert TOKEN_TIMEOUT_S - 0.5 < gaps[-1] < TOKEN_TIMEOUT_S + MOVE_GAP_S
    assert late_code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert FIRST_TOKEN_TIMEOUT_S - 0.5 < late_wait < 2 * FIRST_TOKEN_TIMEOUT_S + SLACK_S
    # Thawed, the workers drop the cancelled streams, heartbeat back into the registry,
    # and the un-pulled KV of the late request is unpinned by its lease expiry (or, if
    # the thawed worker pulls it first, released): that one lease may expire, no other.
    _wait_registry(cluster, present={c.name for c in frozen})
    _wait_kv_leases_ended(probe)
    assert asyncio.run(serve(cluster, 3, "ss-after"))
    assert_cluster_clean(probe, allow_expired_kv=1)


def test_kill9_prefill_mid_prefill_is_retried_then_restart_rehandshakes(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)
    before = asyncio.run(serve(cluster, 8, "kp-before"))  # decode workers meet both
    kv_ports = {c.name: asyncio.run(kv_transfer_port(c.address)) for c in pool(cluster, "prefill")}

    async def scenario() -> tuple[str, list[gateway_pb2.GenerateResponse], list[list[object]]]:
        long = asyncio.ensure_future(
            _collect(cluster.gateway_address, prompt=_unique_long_prompt(), max_tokens=4)
        )
        victim = await busy_prefill(cluster, long)
        kill(victim)
        others = [_collect(cluster.gateway_address, prompt=_prompt(f"kp{i}"), max_tokens=3)
                  for i in range(3)]  # fmt: skip
        done = await asyncio.gather(long, *others)
        assert victim.name not in await reachable(cluster)  # the gateway tried and failed
        return victim.name, cast(list[gateway_pb2.GenerateResponse], done[0]), done[1:]

    victim, msgs, others = asyncio.run(scenario())
    try:
        # Retried before token 1 on the other worker: the client sees no error at all.
        assert msgs[0].prefill_worker != victim and msgs[-1].finished
        assert all(o[-1].finished for o in others)  # type: ignore[attr-defined]
    finally:
        # Same id, same gRPC and KV-transfer ports, new incarnation: the decode workers'
        # NIXL metadata for that address is stale and must be replaced by a handshake.
        restart_on_same_ports(cluster, victim, kv_ports[victim])
    ready = time.monotonic()
    while victim not in asyncio.run(reachable(cluster)):  # the gateway picks it up again
        assert time.monotonic() - ready < MEMBERSHIP_REFRESH_S + SLACK_S
        time.sleep(0.1)
    stale = {decode for prefill, decode in before if prefill == victim}
    served: set[str] = set()
    for i in range(20):  # until a decode worker that knew the old incarnation is hit
        pairs = asyncio.run(serve(cluster, 1, f"kp-after{i}"))
        served |= {decode for prefill, decode in pairs if prefill == victim}
        if served & stale:
            break
    assert stale and served & stale, (before, served)
    assert_cluster_clean(probe)


def test_kill9_last_prefill_worker_mid_prefill_is_unavailable(cluster: LocalCluster) -> None:
    probe = start_probe(cluster)
    first, second = pool(cluster, "prefill")
    kv_ports = {c.name: asyncio.run(kv_transfer_port(c.address)) for c in (first, second)}
    kill(first)
    _wait_registry(cluster, present=set(), absent=frozenset({first.name}))

    async def scenario() -> tuple[grpc.aio.AioRpcError, float, grpc.StatusCode]:
        async with GatewayClient(cluster.gateway_address) as client:
            decoding = await Stream.open(client, _prompt("lp-decoding"), 100)
            long = client.complete(
                build_request(_unique_long_prompt(), RequestOptions(max_tokens=4))
            )
            long_call = asyncio.ensure_future(long)
            killed = kill(await busy_prefill(cluster, long_call))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await long_call
            failed = time.monotonic() - killed
            code, _ = await decoding.finish()  # already past prefill: unaffected
        return info.value, failed, code

    try:
        error, failed, decoding_code = asyncio.run(scenario())
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "prefill" in (error.details() or "")
        assert failed < FAIL_FAST_S
        assert decoding_code == grpc.StatusCode.OK
    finally:
        for child in (first, second):
            restart_on_same_ports(cluster, child.name, kv_ports[child.name])
    _wait_registry(cluster, present={first.name, second.name})
    assert asyncio.run(serve(cluster, 4, "lp-after"))
    assert_cluster_clean(probe)


# -- Redis and the router -------------------------------------------------------------


def test_redis_restart_fails_open_then_resyncs_from_heartbeats(cluster: LocalCluster) -> None:
    assert cluster.redis is not None
    probe = start_probe(cluster)
    workers = {c.name for c in cluster.children if c.name != "gateway"}

    async def scenario() -> tuple[grpc.StatusCode, int]:
        assert cluster.redis is not None
        async with GatewayClient(cluster.gateway_address) as client:
            spanning = await Stream.open(client, _prompt("rr-spanning"), 100)
            cluster.redis.stop()  # its data is gone with it
            await serve(cluster, 3, "rr-down")  # fail open on the last known workers
            cluster.redis.start()  # same port, empty
            await asyncio.to_thread(_wait_registry, cluster, workers)  # heartbeats refill it
            placed = 0
            end = time.monotonic() + HEARTBEAT_TTL_S + SLACK_S
            while not placed and time.monotonic() < end:  # until routing uses Redis again
                probe = await Stream.open(client, _prompt("rr-probe"), 20)
                placed = LoadLedger(connect(cluster.redis.url), Keyspace()).snapshot("decode").total
                assert (await probe.finish())[0] == grpc.StatusCode.OK
            code, _ = await spanning.finish()
        return code, placed

    code, placed = asyncio.run(scenario())
    assert code == grpc.StatusCode.OK and placed >= 1
    assert_cluster_clean(probe)  # expiry counters restarted with Redis: counted from 0


def test_killed_router_replica_load_expires_and_others_route() -> None:
    ttl = 3.0
    with EmbeddedRedis(tcp=True) as server:
        client = connect(server.url, 2.0)
        registry = Registry(client, Keyspace(), ttl_s=60)
        for i in range(2):
            for role in ("prefill", "decode"):
                registry.register(WorkerInfo(f"{role}{i}", role, "m", "l", f"127.0.0.1:{4100 + i}"))
        routers = [_start_router(server.url, "--load-ttl-s", str(ttl)) for _ in range(2)]
        # No worker process here (the registered addresses are not served): Redis only.
        probe = start_probe(ProbeTarget(lambda: [], LeaseTtls(KV_LEASE_TTL_S, ttl),
                                        lambda: server.url))  # fmt: skip
        try:
            asyncio.run(_replicas_scenario([a for _, a in routers], routers[0][0], ttl, client))
            # The dead replica's 6 decisions (one lease per pool each) ended by expiry,
            # exactly those: the survivor's were released.
            leaks = assert_cluster_clean(probe, allow_expired_load=12)
            assert leaks.expired_load == {"prefill": 6, "decode": 6}
        finally:
            for proc, _ in routers:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=10)
            client.close()


async def _replicas_scenario(
    addresses: list[str], doomed: subprocess.Popen[str], ttl: float, client: redis.Redis
) -> None:
    ledger = LoadLedger(client, Keyspace())

    async def route(address: str, n: int, tag: str) -> list[str]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            leases = []
            for i in range(n):
                reply = await stub.Route(router_pb2.RouteRequest(
                    request_id=f"{tag}{i}", prompt_token_ids=[i] * 40), timeout=5)  # fmt: skip
                leases += list(reply.load_lease_ids)
            return leases

    await route(addresses[0], 6, "a")  # placed by the replica about to die, never released
    placed_at = time.monotonic()
    doomed.kill()
    doomed.wait(timeout=10)
    kept = await route(addresses[1], 6, "b")  # the other replica keeps routing
    async with grpc.aio.insecure_channel(addresses[1]) as channel:
        await router_pb2_grpc.RouterStub(channel).Release(
            router_pb2.ReleaseLoadRequest(load_lease_ids=kept), timeout=5
        )
    orphans = ledger.snapshot("prefill").total + ledger.snapshot("decode").total
    assert orphans == 12  # the dead replica's 6 decisions, one lease per pool each
    await asyncio.sleep(max(0.0, placed_at + ttl + 0.2 - time.monotonic()))
    assert ledger.snapshot("prefill").total == ledger.snapshot("decode").total == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await route(addresses[0], 1, "dead")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
