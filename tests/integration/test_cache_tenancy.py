"""Tenants sharing a decode worker's KV cache, through real processes on 127.0.0.1: cache
fairness and preemption by swap.

One cluster: 1 prefill + 1 decode worker, embedded Redis, a gateway with API keys, the
workers' pools cut to 64 blocks with a small offload tier. Every prompt takes the prefill
hop (`local_prefill_max_tokens` 0): at the default threshold where a prompt is
prefilled depends on how busy the decode worker looked, and the hit counts would follow
the routing rather than the cache. The prefill worker holds each prompt's KV for export,
the decode worker imports it; both pools are shared by the tenants.
- Tenant `hot` sends a request with a long system prompt; tenant `flood` then sends
  unique prompts worth twice the pool; `hot` asks again and still hits its prefix on
  the prefill worker
  (under one least-recently-freed list the flood evicts it: tests/unit/engine/
  test_cache_share.py shows that side).
- A sheddable stream runs long on the decode worker; a critical one joins it and the
  pool runs dry: the sheddable stream is preempted, its blocks go to the offload tier
  and come back on resume, and its tokens equal the same stream's when it ran alone.
  These two go to the worker's Decode RPC directly, as a gateway would send them: the
  gateway's admission would hold the second until the first was done.
The leak probe ends each test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import grpc
import pytest

from engine.model_store import DEFAULT_MODEL_NAME
from engine.priority import Priority
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2_grpc
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from services.common.request_codec import decode_request
from tests.conftest import MODEL_CACHE, EngineFactory
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.prompts import long_prompt

# Pins (tests/integration/pins.py): a stream preempted and swapped back equals its run
# alone, token for token.
pytestmark = pytest.mark.pins(Pin.FLOAT32)

# Serial, not pairable: how the flood's requests overlap on the prefill worker decides
# which of the guard's cases each allocation meets (docs/engine.md, "Cache fairness").
# Its chunked growth evicting the hot prefix (fixed by the growth rule) failed CI
# serially and a paired run before that; this stays serial until paired runs have
# shown the fix holds there too.

KEYS = {
    "hot": ("hot-tenant-key-000000001", "max_class=critical"),
    "flood": ("flood-tenant-key-00000002", ""),
    "batch": ("batch-tenant-key-00000003", "class=sheddable"),
}
TEXT = long_prompt(40)
SYSTEM = TEXT[:1500]  # about 330 tokens: 20 of the pool's 64 blocks
RESUMED = "pdserve_preemption_resume_tokens_total"
STREAM_TOKENS = 300
TIER = 24 * 368_640  # 24 blocks of the default model's bf16 KV


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{t} {key} {opts}\n" for t, (key, opts) in KEYS.items()))
    cfg = ClusterConfig(
        gateway_port=0, model_cache_dir=MODEL_CACHE, api_keys_file=str(keys),
        local_prefill_max_tokens=0, worker_args=f"--num-kv-blocks 64 --kv-offload-bytes {TIER}",
    )  # fmt: skip
    c = LocalCluster(cfg)
    c.start()
    yield c
    c.stop()


async def _complete(
    session: aiohttp.ClientSession, http: str, tenant: str, prompt: str, max_tokens: int,
    priority: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS[tenant][0]}"}
    if priority is not None:
        headers["x-pdserve-priority"] = priority
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    url = f"http://{http}/v1/completions"
    async with session.post(url, json=body, headers=headers) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data  # type: ignore[no-any-return]


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _decode_metrics(cluster: LocalCluster) -> dict[str, float]:
    port = next(c.metrics_port for c in cluster.children if c.name == "decode-0")
    assert port is not None
    return scrape(port)


def test_a_flood_of_unique_prompts_leaves_another_tenants_prefix_cached(
    cluster: LocalCluster,
) -> None:
    probe = start_probe(cluster)

    async def scenario() -> list[int]:
        hits = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            http = cluster.http_addresses[0]
            for r in range(3):
                answer = await _complete(session, http, "hot", f"{SYSTEM} Question {r}?", 2)
                hits.append(_cached(answer))
                # 8 unique prompts of about 260 tokens: twice the pool, every round.
                floods = [
                    f"Flood {r}.{i}: {TEXT[2000 + 300 * i : 3200 + 300 * i]}" for i in range(8)
                ]
                await asyncio.gather(*(_complete(session, http, "flood", p, 2) for p in floods))
        return hits

    hits = asyncio.run(scenario())
    assert hits[0] == 0
    assert all(h >= 16 * 18 for h in hits[1:]), hits  # the system prompt's full blocks hit
    assert_cluster_clean(probe)


async def _decode(address: str, prompt: list[int], priority: Priority, salt: str) -> list[int]:
    """One greedy stream straight from the decode worker (its mixed path computes the
    prompt too): the gateway's admission reserves prompt + max_tokens blocks and would
    never let two streams outgrow the pool, so this plays a gateway that did (another
    replica, a stale signal)."""
    params = SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True)
    spec = RequestSpec(prompt, params, request_id=uuid.uuid4().hex, cache_salt=salt,
                       priority=priority)  # fmt: skip
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        async for chunk in worker_pb2_grpc.WorkerStub(channel).Decode(decode_request(spec)):
            tokens += chunk.token_ids
    return tokens


def test_a_preempted_stream_swaps_back_in_and_keeps_its_tokens(
    cluster: LocalCluster, make_engine: EngineFactory
) -> None:
    probe = start_probe(cluster)
    tokenizer = make_engine(num_kv_blocks=8).tokenizer
    batch = tokenizer.encode(TEXT[6000:7600])[:340]  # 22 blocks, 41 at the end
    urgent = tokenizer.encode(TEXT[9000:10600])[:340]  # the same: 82 > the pool's 64
    decode = next(c.address for c in cluster.children if c.name == "decode-0")

    async def scenario() -> tuple[list[int], list[int]]:
        alone = await _decode(decode, batch, Priority.SHEDDABLE, "batch")
        contested = asyncio.create_task(_decode(decode, batch, Priority.SHEDDABLE, "batch"))
        await asyncio.sleep(1.0)  # it decodes; then a critical stream joins it
        await _decode(decode, urgent, Priority.CRITICAL, "hot")
        return alone, await contested

    before = _decode_metrics(cluster)
    alone, contested = asyncio.run(scenario())
    after = _decode_metrics(cluster)
    assert after["pdserve_preemptions_total"] > before["pdserve_preemptions_total"]
    swapped = f"{RESUMED}{{how=swapped}}"
    assert after[swapped] > before[swapped], after  # blocks came back from the tier
    assert contested == alone
    assert_cluster_clean(probe)
