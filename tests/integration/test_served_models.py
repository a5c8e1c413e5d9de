"""Three models in one cluster, on real processes: the default model on a prefill and a
decode worker, and two extra models (`--extra-models`), each on its own mixed worker,
which registers in the model's pool namespace: a tiny random Llama (another shape and
tokenizer), and a twin of the default model (the same config, tokenizer and chat
template, every weight moved: a fine-tune of the same shape). `model` picks the workers;
`/v1/models` and ListModels list every model; the models' workers never meet (each pool
has its own registry, so no placement and no KV hand-off crosses between them); the twin
is told apart from the default model by its weights alone: its identity differs in the
weights digest only, its fingerprints differ, and it answers with its own weights;
nothing is held afterwards."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_identity import IdentityPart, ModelIdentity
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.keyspace import Keyspace, pool_namespace
from services.router.load import LoadLedger
from services.router.redis_client import connect
from services.router.registry import Registry, WorkerInfo
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster
from tests.tiny_models import VOCAB_SIZE, write_tiny_model

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): a model's requests run on its own prefill and decode
# workers.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.PREFILL_HOP)]

TINY = "tiny"
TWIN = "twin"
TWIN_PROMPT = "The capital of France is"  # one the twin answers otherwise than the model


def write_twin(model_dir: Path, path: Path, seed: int = 0) -> None:
    """`model_dir` with every weight scaled by its own factor 1 + N(0, 0.1) (a fixed
    seed) into `path`; every other file (config, tokenizer, chat template) copied as it
    is."""
    path.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in model_dir.glob("*.safetensors"):
        weights = load_file(f)
        for w in weights.values():
            w.mul_(1 + 0.1 * torch.randn(w.shape, generator=gen, dtype=w.dtype))
        save_file(weights, path / f.name, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("models") / TWIN
    write_twin(model_dir, path)
    yield path
    shutil.rmtree(path)  # half a gigabyte, which pytest would keep for three more runs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, twin_dir: Path) -> Iterator[LocalCluster]:
    tiny_dir = tmp_path_factory.mktemp("models") / TINY
    write_tiny_model("llama3", tiny_dir)
    c = _cluster(num_prefill=1, num_decode=1, placement="redis", http_port=0,
                 extra_models=f"{TINY}={tiny_dir},{TWIN}={twin_dir}")  # fmt: skip
    yield c
    c.stop()


async def _generate(
    address: str, model: str, prompt: str = "w5 w6 w7"
) -> tuple[list[int], set[str], str]:
    """Six greedy tokens of `prompt` by `model`, and the workers that served them."""
    async with GatewayClient(address) as client:
        request = build_request(
            prompt, RequestOptions(max_tokens=6, temperature=0.0, ignore_eos=True, model=model)
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
    _assert_load_released(cluster, TINY)


def _assert_load_released(cluster: LocalCluster, model: str) -> None:
    """The extra model's pool holds no load lease (within 5 s)."""
    assert cluster.redis is not None
    pool = Keyspace(pool_namespace("pdserve", model))
    ledger = LoadLedger(connect(cluster.redis.url, 2.0), pool)
    end = time.monotonic() + 5.0
    while ledger.snapshot("mixed").counts and time.monotonic() < end:
        time.sleep(0.05)  # the gateway gives the load lease back after the stream ends
    assert ledger.snapshot("mixed").counts == {}


def test_every_model_is_listed(cluster: LocalCluster) -> None:
    with urllib.request.urlopen(f"http://{cluster.http_address}/v1/models", timeout=10) as r:
        ids = [card["id"] for card in json.load(r)["data"]]
    assert ids == ["SmolLM2-135M-Instruct", TINY, TWIN]

    async def listed() -> list[str]:
        async with GatewayClient(cluster.gateway_address) as client:
            return [m.id for m in (await client.list_models()).models]

    assert asyncio.run(listed()) == ids


def _registered(cluster: LocalCluster, model: str = "") -> list[WorkerInfo]:
    assert cluster.redis is not None
    namespace = pool_namespace("pdserve", model) if model else "pdserve"
    return Registry(connect(cluster.redis.url, 2.0), Keyspace(namespace)).list()


def test_each_model_has_its_own_registry(cluster: LocalCluster) -> None:
    base, tiny, twin = (_registered(cluster, m) for m in ("", TINY, TWIN))
    assert {w.worker_id for w in base} == {"prefill-0", "decode-0"}
    assert [w.worker_id for w in tiny] == [f"{TINY}-0"]
    assert [w.worker_id for w in twin] == [f"{TWIN}-0"]
    # Another shape: another tokenizer, and another fingerprint.
    assert tiny[0].identity is not None and base[0].identity is not None
    assert tiny[0].identity.tokenizer != base[0].identity.tokenizer
    assert {w.model for w in base}.isdisjoint({w.model for w in tiny})


def test_a_model_of_the_same_shape_is_told_apart_by_its_weights(
    cluster: LocalCluster, model_dir: Path, twin_dir: Path
) -> None:
    base, twin = _registered(cluster), _registered(cluster, TWIN)
    ours = ModelIdentity.of_dir(model_dir, progress=False)
    theirs = ModelIdentity.of_dir(twin_dir, progress=False)
    # Each worker published the identity of the directory it was given. The twin's
    # differs in the weights alone (config, tokenizer and chat template agree), which the
    # gateway's identity check lets pass; its fingerprints keep KV and prefix keys apart.
    assert [w.identity for w in base] == [ours, ours] and twin[0].identity == theirs
    assert ours.differences(theirs) == [IdentityPart.WEIGHTS]
    assert twin[0].model not in {w.model for w in base}
    assert twin[0].layout_fingerprint not in {w.layout_fingerprint for w in base}
    # Each model's requests go to its own workers, which compute with its own weights:
    # the greedy answers part at the second token (HF float32: the default model's
    # argmax there has probability 0.68, the twin's another token at 0.59).
    probe = start_probe(cluster)
    address = cluster.gateway_address
    ours_tokens, ours_workers, _ = asyncio.run(_generate(address, "", TWIN_PROMPT))
    twin_tokens, twin_workers, _ = asyncio.run(_generate(address, TWIN, TWIN_PROMPT))
    assert ours_workers == {"prefill-0", "decode-0"} and twin_workers == {f"{TWIN}-0"}
    assert len(ours_tokens) == len(twin_tokens) == 6 and ours_tokens != twin_tokens
    assert_cluster_clean(probe)
    _assert_load_released(cluster, TWIN)
