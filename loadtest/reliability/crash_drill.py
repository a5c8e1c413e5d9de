"""The crash drill: a decode worker killed (-9) under load, and how long what it held
on the rest of the cluster takes to come back.

A decode worker that dies takes its own KV blocks with it, but leaves things behind
elsewhere: the prefill worker's exported KV (blocks pinned under a lease) for requests it
had not pulled yet or was pulling, the gateway's load leases on it in Redis, and the
gateway's request records. The lease TTLs bound how long any of it can stay; the
gateway's cleanup (aborting un-pulled KV, releasing load) should return it much sooner.

Lifecycle: `run_crash_drill(cluster, cfg)` keeps `cfg.concurrency` long-prompt streams
(long enough to take the prefill hop) going through the gateway, stops sending once
`cfg.warm_s` has passed, kills the first decode worker with those streams in flight, and
then reads the cluster with the
leak probe (`leak_probe.LeakProbe`, baseline before the first stream) every
`POLL_S` until nothing is held anywhere, or until the KV lease TTL plus `cfg.slack_s`.
`CrashDrill.returned_s` is the time from the kill to that clean reading (None if it
never came); the target is the KV lease TTL, the longest any exported block may stay
pinned. KV leases that ended by expiry rather than a release are counted, not failed:
after a crash, expiry is how some of them end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from loadtest.reliability.leak_probe import LeakProbe, Leaks, LeaseTtls, ProbeTarget
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request

POLL_S = 0.1
#: Leases ended by expiry are expected after a crash: the probe counts them, never fails.
ANY = 1 << 30
#: Words of each prompt (about 5 tokens each): over the gateway's default local-prefill
#: limit (512 tokens), so a request takes the prefill hop and leaves exported KV for the
#: decode worker, and short enough that the prefills in flight at the kill end soon.
PROMPT_WORDS = 130


@dataclass(frozen=True)
class CrashDrillConfig:
    concurrency: int = 8
    max_tokens: int = 48
    warm_s: float = 6.0  # streams run this long before the kill
    slack_s: float = 5.0  # how far past the KV lease TTL the drill keeps reading

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_tokens < 1 or self.warm_s <= 0 or self.slack_s < 0:
            raise ValueError("need concurrency, max_tokens >= 1, warm_s > 0, slack_s >= 0")


@dataclass(frozen=True)
class CrashDrill:
    killed: str  # the decode worker killed
    streams: int
    outcomes: dict[str, int]  # "ok" or a gRPC status name, per stream
    streams_ended_s: float  # kill -> the last stream ended (finished or failed)
    returned_s: float | None  # kill -> nothing held anywhere; None: not within the bound
    bound_s: float  # how long the drill read before it gave up
    kv_lease_ttl_s: float  # the target
    expired_kv_leases: int  # exported KV unpinned by its lease's expiry, not a release
    residue: Leaks  # the last reading (clean when returned_s is set)

    @property
    def met(self) -> bool:
        return self.returned_s is not None and self.returned_s <= self.kv_lease_ttl_s


def _prompt(n: int) -> str:
    words = " ".join(f"w{(n * 7919 + i) % 5000}" for i in range(PROMPT_WORDS))
    return f"Stream {n}. Read the list and say which word comes first: {words}"


async def _stream(client: GatewayClient, n: int, max_tokens: int) -> str:
    options = RequestOptions(max_tokens=max_tokens, ignore_eos=True)
    try:
        async for msg in client.generate(build_request(_prompt(n), options), timeout=120.0):
            if msg.finished:
                return "ok"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "EOF"


async def _load(client: GatewayClient, cfg: CrashDrillConfig, stop: asyncio.Event) -> list[str]:
    """Streams at `cfg.concurrency` until `stop` is set; each one's ending."""
    outcomes: list[str] = []
    counter = iter(range(1 << 30))

    async def lane() -> None:
        while not stop.is_set():
            outcomes.append(await _stream(client, next(counter), cfg.max_tokens))

    await asyncio.gather(*(lane() for _ in range(cfg.concurrency)))
    return outcomes


async def _until_returned(probe: LeakProbe, killed_at: float, bound_s: float) -> Leaks:
    while True:
        leaks = await probe.read(allow_expired_kv=ANY, allow_expired_load=ANY)
        if leaks.clean or time.monotonic() - killed_at > bound_s:
            return leaks
        await asyncio.sleep(POLL_S)


async def run_crash_drill(cluster: LocalCluster, cfg: CrashDrillConfig) -> CrashDrill:
    """Kill the cluster's first decode worker under load (it stays dead) and time what
    it held elsewhere coming back."""
    victim = next(c for c in cluster.workers if c.name.startswith("decode-"))
    ttl = LeaseTtls.of(cluster.cfg).kv_s
    probe = await LeakProbe.start(ProbeTarget.local(cluster))
    stop = asyncio.Event()
    async with GatewayClient(cluster.gateway_address) as client:
        load = asyncio.create_task(_load(client, cfg, stop))
        await asyncio.sleep(cfg.warm_s)
        # Stop before the kill: a stream a lane started after it would be new load placed
        # on a dead worker (its prefill queued behind the others), not something the
        # worker held, and on a slow host it alone could outlast the TTL.
        stop.set()
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.to_thread(victim.proc.wait, 10)
        outcomes = await load
    ended = time.monotonic() - killed_at
    leaks = await _until_returned(probe, killed_at, ttl + cfg.slack_s)
    returned = time.monotonic() - killed_at if leaks.clean else None
    return CrashDrill(
        victim.name, len(outcomes), dict(Counter(outcomes)), round(ended, 2),
        None if returned is None else round(returned, 2), ttl + cfg.slack_s, ttl,
        sum(leaks.expired_kv.values()), leaks,
    )  # fmt: skip


def drill_summary(drill: CrashDrill) -> str:
    returned = "never" if drill.returned_s is None else f"{drill.returned_s:.2f} s"
    return (
        f"crash drill: {drill.killed} killed under {drill.streams} streams {drill.outcomes}, "
        f"the last ended {drill.streams_ended_s:.2f} s after the kill; everything it held "
        f"elsewhere back in {returned} (target: the KV lease TTL, "
        f"{drill.kv_lease_ttl_s:g} s), {drill.expired_kv_leases} KV leases ended by expiry"
        f" -> {'met' if drill.met else 'NOT MET'}"
    )
