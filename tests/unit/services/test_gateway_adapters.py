"""The gateway's side of multi-LoRA: a request's `model` names an adapter ("ADAPTER" or
"MODEL:ADAPTER"), every worker call of it carries the adapter with the digest of the
gateway's copy, the model list shows each adapter with its parent, a name that is no
adapter is NOT_FOUND listing those there are, and a replaced adapter is hashed again.
Real Redis and router, fake workers (tests/unit/services/gateway_fakes.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import save_file

from engine.adapter_ref import CONFIG_FILE, WEIGHTS_FILE, AdapterRef, adapter_digest
from services.common.status import UnknownModelError
from services.gateway.client import RequestOptions, build_request
from services.gateway.models.adapter_catalog import AdapterCatalog
from services.gateway.models.catalog import ModelCard
from services.gateway.stream.record_book import Resource
from tests.unit.services.gateway_fakes import PROMPT, Gateway, build_gateway


def _adapter(root: Path, name: str, value: float = 1.0) -> Path:
    """An adapter's two files (the gateway reads their bytes only, never the tensors)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: torch.full((2, 4), value)}, str(path / WEIGHTS_FILE))
    return path


@pytest.fixture
def gw(client: redis.Redis, namespace: str, model_dir: Path, tmp_path: Path) -> Gateway:
    for name in ("alpha", "beta"):
        _adapter(tmp_path / "loras", name)
    gateway = build_gateway(client, namespace, model_dir)
    gateway.service.models.primary.adapters = AdapterCatalog(tmp_path / "loras")
    return gateway


def _run(gw: Gateway, model: str) -> None:
    async def go() -> None:
        request = build_request(PROMPT, RequestOptions(max_tokens=4, request_id="r", model=model))
        async for _ in gw.service.stream(gw.service.decode(request)):
            pass

    asyncio.run(go())


def test_every_worker_call_names_the_adapter(gw: Gateway, tmp_path: Path) -> None:
    digest = adapter_digest(tmp_path / "loras" / "alpha")
    for model in ("alpha", "m:alpha"):
        gw.cluster.adapters.clear()
        _run(gw, model)
        calls = [(call, a.name, a.digest) for call, a in gw.cluster.adapters]
        assert calls == [("prefill", "alpha", digest), ("decode", "alpha", digest)]
    gw.cluster.adapters.clear()
    _run(gw, "m")  # the model itself: no adapter on either call
    assert [a.name for _, a in gw.cluster.adapters] == ["", ""]
    assert gw.service.book.counts() == dict.fromkeys(Resource, 0)


def test_unknown_adapters_are_not_found_with_what_there_is(gw: Gateway) -> None:
    models = gw.service.models
    with pytest.raises(
        UnknownModelError, match=r"no LoRA adapter 'nope' \(adapters: alpha, beta\)"
    ):
        models.resolve("m:nope")
    with pytest.raises(UnknownModelError, match="is not served here"):
        models.resolve("nope")
    with pytest.raises(UnknownModelError, match="is not served here"):
        models.resolve("other:alpha")  # no such model
    models.primary.adapters = None
    with pytest.raises(UnknownModelError, match="serves no LoRA adapters"):
        models.resolve("m:alpha")


def test_adapters_are_listed_under_their_model(gw: Gateway, tmp_path: Path) -> None:
    assert gw.service.models.cards() == [
        ModelCard("m", "", gw.service.models.primary.max_model_len),
        ModelCard("alpha", "m", gw.service.models.primary.max_model_len),
        ModelCard("beta", "m", gw.service.models.primary.max_model_len),
    ]
    models, limit = gw.service.models, gw.service.models.primary.max_model_len
    assert models.card("m") == ModelCard("m", "", limit)  # /v1/models/{id}: as asked for
    assert models.card("m:beta") == ModelCard("m:beta", "m", limit)
    _adapter(tmp_path / "loras", "gamma")  # copied in later: listed (and served) at once
    assert [c.id for c in gw.service.models.cards()][-1] == "gamma"


def test_a_replaced_adapter_is_hashed_again(tmp_path: Path) -> None:
    path = _adapter(tmp_path, "alpha", 1.0)
    catalog = AdapterCatalog(tmp_path)
    first = catalog.resolve("alpha", "m")
    assert catalog.resolve("alpha", "m") == first == AdapterRef("alpha", adapter_digest(path))
    _adapter(tmp_path, "alpha", 2.0)  # same names and shapes, other weights
    second = catalog.resolve("alpha", "m")
    assert second.digest == adapter_digest(path) != first.digest


def test_a_prefill_worker_without_a_free_adapter_slot_is_tried_no_more(
    client: redis.Redis, namespace: str, model_dir: Path, tmp_path: Path
) -> None:
    """RESOURCE_EXHAUSTED from a prefill worker (every adapter slot held) sends the
    request to another prefill worker, and nothing of the first attempt stays held."""
    _adapter(tmp_path / "loras", "alpha")
    gw = build_gateway(client, namespace, model_dir, prefill_workers=2)
    gw.service.models.primary.adapters = AdapterCatalog(tmp_path / "loras")
    gw.cluster.busy_prefills = {1}
    _run(gw, "alpha")
    first, second = gw.cluster.prefills
    assert first != second
    assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
    assert gw.load_counts() == {"prefill": {}, "decode": {}}
