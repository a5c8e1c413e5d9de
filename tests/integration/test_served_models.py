"""Two models in one cluster, on real processes: the default model on a prefill and a
decode worker, and a tiny random Llama as an extra model (`--extra-models`) on its own
mixed worker, which registers in the model's pool namespace. `model` picks the workers;
`/v1/models` and ListModels list both; the two models' workers never meet (each pool has
its own registry, so no placement and no KV hand-off crosses between them); nothing is
held afterwards."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.keyspace import Keyspace, pool_namespace
from services.router.load import LoadLedger
from services.router.redis_client import connect
from services.router.registry import Registry
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.test_cluster import _cluster
from tests.tiny_models import VOCAB_SIZE, write_tiny_model

TINY = "tiny"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tiny_dir = tmp_path_factory.mktemp("models") / TINY
    write_tiny_model("llama3", tiny_dir)
    c = _cluster(num_prefill=1, num_decode=1, placement="redis", http_port=0,
                 extra_models=f"{TINY}={tiny_dir}")  # fmt: skip
    yield c
    c.stop()


async def _generate(address: str, model: str) -> tuple[list[int], set[str], str]:
    async with GatewayClient(address) as client:
        request = build_request(
            "w5 w6 w7", RequestOptions(max_tokens=6, ignore_eos=True, model=model)
        )
        msgs = [m async for m in client.generate(request)]
    workers = {w for m in msgs for w in (m.prefill_worker, m.decode_worker) if w}
    return [t for m in msgs for t in m.token_ids], workers, "".join(m.text for m in msgs)


def test_model_picks_the_workers(cluster: LocalCluster) -> None:
    probe = start_probe(cluster)
    tokens, workers, text = asyncio.run(_generate(cluster.gateway_address, TINY))
    assert workers == {f"{TINY}-0"} and len(tokens) == 6
    assert all(t < VOCAB_SIZE for t in tokens) and text.split()[0].startswith("w")
    tokens, workers, _ = asyncio.run(_generate(cluster.gateway_address, ""))
    assert workers == {"prefill-0", "decode-0"} and len(tokens) == 6
    assert_cluster_clean(probe)  # every worker's blocks and leases, the base pools' load
    assert cluster.redis is not None
    ledger = LoadLedger(connect(cluster.redis.url, 2.0), Keyspace(pool_namespace("pdserve", TINY)))
    end = time.monotonic() + 5.0
    while ledger.snapshot("mixed").counts and time.monotonic() < end:
        time.sleep(0.05)  # the gateway gives the load lease back after the stream ends
    assert ledger.snapshot("mixed").counts == {}


def test_both_models_are_listed(cluster: LocalCluster) -> None:
    with urllib.request.urlopen(f"http://{cluster.http_address}/v1/models", timeout=10) as r:
        ids = [card["id"] for card in json.load(r)["data"]]
    assert ids == ["SmolLM2-135M-Instruct", TINY]

    async def listed() -> list[str]:
        async with GatewayClient(cluster.gateway_address) as client:
            return [m.id for m in (await client.list_models()).models]

    assert asyncio.run(listed()) == ids


def test_each_model_has_its_own_registry(cluster: LocalCluster) -> None:
    assert cluster.redis is not None
    client = connect(cluster.redis.url, 2.0)
    base = Registry(client, Keyspace("pdserve")).list()
    tiny = Registry(client, Keyspace(pool_namespace("pdserve", TINY))).list()
    assert {w.worker_id for w in base} == {"prefill-0", "decode-0"}
    assert [w.worker_id for w in tiny] == [f"{TINY}-0"]
    # Different models: different fingerprints, so different KV layouts too.
    assert {w.model for w in base}.isdisjoint({w.model for w in tiny})
    assert tiny[0].identity is not None and base[0].identity is not None
    assert tiny[0].identity.tokenizer != base[0].identity.tokenizer
