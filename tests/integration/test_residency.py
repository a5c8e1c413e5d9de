"""The index the workers feed, end to end: two mixed workers behind the gateway (the
defaults: bf16, conditional disaggregation on), each reporting its prefix cache.

- A prompt is served once (its ring owner caches it), then three times at once (the
  load bound spills one to the other worker, which caches it too). The owner is killed
  -9 and restarted under the same id with an empty cache. From the moment it is ready,
  every request of that prompt goes to the worker that really holds it. The router's
  own cache model cannot tell: it remembers the prompt on both, and its tie-break (the
  ring's order) would send it back to the owner.
- Under eviction pressure (16 distinct prompts of 14 blocks through two pools of 45),
  one report interval after the traffic stops each worker's reported set is the size
  of its pool's prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from pdserve.v1 import worker_pb2
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.residency import ResidencyBoard
from tests.integration.cluster_drills import kill, named
from tests.integration.test_cluster import _cluster

WORKERS = ("mixed-0", "mixed-1")
PROMPT = [2000 + (i * 37) % 3000 for i in range(16 * 12 + 3)]  # twelve full blocks
SIGNAL_INTERVAL_S = 0.25  # the workers' default --signal-interval-s


@pytest.fixture(scope="module")
def mixed_pair() -> Iterator[LocalCluster]:
    # Pools of 45 blocks each (bf16): a few prompts fill them, so eviction starts early.
    cluster = _cluster(num_prefill=0, num_decode=2, worker_kv_cache_bytes=16 << 20)
    yield cluster
    cluster.stop()


async def _send(address: str, prompt: list[int], n: int, max_tokens: int) -> None:
    """`n` requests of `prompt` at once; each must finish."""

    async def one(client: GatewayClient) -> None:
        request = build_request(None, RequestOptions(max_tokens=max_tokens, ignore_eos=True))
        request.prompt_token_ids.ids.extend(prompt)
        msgs = [m async for m in client.generate(request)]
        assert msgs[-1].finished

    async with GatewayClient(address) as client:
        await asyncio.gather(*(one(client) for _ in range(n)))


async def _prompt_tokens(address: str) -> dict[str, tuple[int, int]]:
    """Worker id -> (prompt tokens it was asked for, of which prefix-cache hits)."""
    async with GatewayClient(address) as client:
        status = await client.cluster_status()
    return {w.worker_id: (w.prefix_query_tokens, w.prefix_hit_tokens) for w in status.workers}


def _served(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> set[str]:
    return {w for w in WORKERS if after[w][0] > before.get(w, (0, 0))[0]}


def test_a_restarted_worker_stops_receiving_the_prefixes_it_lost(mixed_pair: LocalCluster) -> None:
    address = mixed_pair.gateway_address
    before = asyncio.run(_prompt_tokens(address))
    asyncio.run(_send(address, PROMPT, 1, 2))
    middle = asyncio.run(_prompt_tokens(address))
    (owner,) = _served(before, middle)
    other = next(w for w in WORKERS if w != owner)
    asyncio.run(_send(address, PROMPT, 3, 24))  # the bound spills one of them to `other`
    after = asyncio.run(_prompt_tokens(address))
    assert _served(middle, after) == set(WORKERS), (middle, after)

    child = named(mixed_pair, owner)
    port = child.address.rsplit(":", 1)[1]
    kill(child)
    mixed_pair.relaunch(owner, "--port", port)
    ready = time.monotonic()
    restarted = asyncio.run(_prompt_tokens(address))
    for i in range(4):
        asyncio.run(_send(address, PROMPT, 1, 2))
        now = asyncio.run(_prompt_tokens(address))
        assert _served(restarted, now) == {other}, (i, restarted, now)
        hits = now[other][1] - restarted[other][1]
        assert hits >= (i + 1) * 12 * 16, now  # it served them from its cache
    assert time.monotonic() - ready < 10.0  # four short requests, not a retry storm


def test_under_eviction_pressure_the_reported_sets_match_the_pools(
    mixed_pair: LocalCluster,
) -> None:
    address = mixed_pair.gateway_address
    prompts = [[5000 + 131 * p + i for i in range(16 * 14)] for p in range(16)]
    for start in range(0, len(prompts), 4):
        batch = prompts[start : start + 4]
        asyncio.run(_gather(address, batch))
    time.sleep(2 * SIGNAL_INTERVAL_S)  # one interval to report, one for a step in flight
    assert mixed_pair.redis is not None
    board = ResidencyBoard(connect(mixed_pair.redis.url, 2.0), Keyspace(), ttl_s=2.0)
    sizes = {}
    for w in asyncio.run(_worker_stats(address)):
        got = board.read(w.worker_id)
        assert got is not None, w.worker_id
        sizes[w.worker_id] = (len(got.hashes), w.cached_blocks, w.total_blocks)
    assert all(reported == cached for reported, cached, _ in sizes.values()), sizes
    # The pressure was real: more prompt blocks went through than both pools hold.
    assert sum(total for _, _, total in sizes.values()) < 48 * 14, sizes


async def _gather(address: str, prompts: list[list[int]]) -> None:
    await asyncio.gather(*(_send(address, p, 1, 2) for p in prompts))


async def _worker_stats(address: str) -> list[worker_pb2.WorkerStats]:
    async with GatewayClient(address) as client:
        return list((await client.cluster_status()).workers)
