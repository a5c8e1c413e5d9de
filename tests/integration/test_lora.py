"""Multi-LoRA on real processes: a prefill and a decode worker and a gateway, all given
the same `--lora-dir` of two PEFT adapters. Requests of the base model and of both
adapters run at once and each equals transformers + PEFT token for token, both where the
prompt takes the prefill hop (KV moved over the transfer backend, the handle carrying
the adapter's digest) and where the decode worker prefills a short prompt itself
(conditional disaggregation); the adapters are listed with their parent; the workers
publish the adapters they hold (what placement prefers); an unknown adapter is a clear
NOT_FOUND; nothing is held afterwards."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster
from tests.lora_adapters import RECIPES, peft_greedy, write_adapter
from tests.prompts import SHORT, long_prompt

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): adapter outputs equal PEFT's float32 greedy tokens.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.FLOAT32)]

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 12
BASE = "SmolLM2-135M-Instruct"
# The short prompts stay on the decode worker (under the local-prefill threshold), the
# long one takes the prefill hop.
LOCAL_MAX_TOKENS = 64
NAMES = ("", "alpha", f"{BASE}:beta")  # the base model, an adapter by name, and by model:name


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Any]:
    """The adapters' directory, the prompts and transformers + PEFT's continuations."""
    from engine.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("loras")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.eval()
    tok = Tokenizer(model_dir)
    prompts = [tok.encode(SHORT[0]), tok.encode(SHORT[3]), tok.encode(long_prompt(4))]
    assert len(prompts[-1]) > LOCAL_MAX_TOKENS > max(len(p) for p in prompts[:-1])
    refs = {"": peft_greedy(base, prompts, MAX_TOKENS)}
    for name in ("alpha", "beta"):
        model = write_adapter(base, root / name, RECIPES[name])
        refs[name] = peft_greedy(model, prompts, MAX_TOKENS)
    return {"dir": root, "prompts": prompts, "refs": refs}


@pytest.fixture(scope="module")
def cluster(setup: dict[str, Any]) -> Iterator[LocalCluster]:
    c = _cluster(num_prefill=1, num_decode=1, placement="redis", http_port=0,
                 lora_dir=str(setup["dir"]), max_loras=2,
                 local_prefill_max_tokens=LOCAL_MAX_TOKENS)  # fmt: skip
    yield c
    c.stop()


async def _generate(address: str, prompt: list[int], model: str) -> tuple[list[int], str]:
    """The stream's tokens and 'prefill worker>decode worker'."""
    request = build_request(
        options=RequestOptions(max_tokens=MAX_TOKENS, temperature=0.0, model=model)
    )
    request.prompt_token_ids.ids.extend(prompt)
    async with GatewayClient(address) as client:
        msgs = [m async for m in client.generate(request)]
    prefill = next((m.prefill_worker for m in msgs if m.prefill_worker), "")
    decode = next((m.decode_worker for m in msgs if m.decode_worker), "")
    return [t for m in msgs for t in m.token_ids], f"{prefill}>{decode}"


def test_base_and_adapters_together_match_peft(
    cluster: LocalCluster, setup: dict[str, Any]
) -> None:
    probe = start_probe(cluster)
    jobs = [(p, name) for p in range(len(setup["prompts"])) for name in NAMES]

    async def run_all() -> list[tuple[list[int], str]]:
        # One prompt at a time (a busy decode worker would send short prompts on the hop
        # too), its three models at once: one batch mixing them on each worker.
        out: list[tuple[list[int], str]] = []
        for prompt in setup["prompts"]:
            address = cluster.gateway_address
            out += await asyncio.gather(*(_generate(address, prompt, n) for _, n in jobs[:3]))
        return out

    results = asyncio.run(run_all())
    for (p, name), (tokens, _) in zip(jobs, results, strict=True):
        adapter = name.rpartition(":")[2]
        assert tokens == setup["refs"][adapter][p], f"prompt {p}, model {name!r}"
    # Who prefilled>decoded: one worker for a short prompt (the decode worker itself, or
    # with elastic roles the prefill worker, whole, beside a loaded decode worker), the
    # hop for the long one; so every path ran the base model and both adapters.
    sites = {(p, hops) for (p, _), (_, hops) in zip(jobs, results, strict=True)}
    whole = {"decode-0>decode-0", "prefill-0>prefill-0"}
    assert {h for p, h in sites if p < 2} <= whole and (2, "prefill-0>decode-0") in sites
    assert {h for p, h in sites} - whole == {"prefill-0>decode-0"}, sites
    assert_cluster_clean(probe)


def test_workers_publish_the_adapters_they_hold(
    cluster: LocalCluster, setup: dict[str, Any]
) -> None:
    asyncio.run(_generate(cluster.gateway_address, setup["prompts"][2], "alpha"))
    assert cluster.redis is not None
    registry = Registry(connect(cluster.redis.url, 2.0), Keyspace("pdserve"))
    held: dict[str, tuple[str, ...]] = {}
    for _ in range(100):  # the next heartbeat carries them (ttl/3)
        held = {w.worker_id: w.adapters for w in registry.list()}
        if all("alpha" in a for a in held.values()):
            break
        time.sleep(0.1)
    assert all("alpha" in a for a in held.values()), held


def test_adapters_are_listed_with_their_parent(cluster: LocalCluster) -> None:
    with urllib.request.urlopen(f"http://{cluster.http_address}/v1/models", timeout=10) as r:
        cards = json.load(r)["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [
        (BASE, None),
        ("alpha", BASE),
        ("beta", BASE),
    ]

    async def listed() -> list[tuple[str, str]]:
        async with GatewayClient(cluster.gateway_address) as client:
            return [(m.id, m.parent) for m in (await client.list_models()).models]

    assert asyncio.run(listed()) == [(BASE, ""), ("alpha", BASE), ("beta", BASE)]


def test_an_unknown_adapter_is_not_found(cluster: LocalCluster) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_generate(cluster.gateway_address, [1, 2, 3], f"{BASE}:nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "adapters: alpha, beta" in str(info.value.details())
    body = json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        f"http://{cluster.http_address}/v1/completions", body,
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=10)
    assert http.value.code == 404


def test_openai_clients_name_an_adapter(cluster: LocalCluster, setup: dict[str, Any]) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="x")
    got = client.completions.create(
        model="beta", prompt=setup["prompts"][0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.model == "beta"
    want = client.completions.create(
        model=f"{BASE}:beta", prompt=setup["prompts"][0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].text == want.choices[0].text
