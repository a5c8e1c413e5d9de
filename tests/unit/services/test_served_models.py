"""A gateway that serves two models: each request goes to the workers of the model it
names (each model's workers register in their own pool namespace), is tokenized and
checked with that model's tokenizer and limits, and an unknown name is NOT_FOUND listing
what is served. Real Redis and routers, fake workers; each test ends with nothing held
in either model's pools."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from engine.errors import InvalidRequestError
from engine.model_spec import ModelSpec
from engine.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2
from services.common.model_config import extra_model_dirs
from services.common.status import UnknownModelError
from services.common.tracing import Tracing
from services.gateway.client import RequestOptions, build_request
from services.gateway.config import GatewayConfig
from services.gateway.flow.admission import Admission
from services.gateway.models.served_model import ServedModelSpec
from services.gateway.stream.metrics import GatewayMetrics
from services.gateway.stream.record_book import Resource
from services.gateway.stream.telemetry import GatewayTelemetry
from services.router.keyspace import Keyspace, pool_namespace
from services.router.redis_placement import RedisPlacement
from services.router.registry import Registry, WorkerInfo
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.tiny_models import write_tiny_model
from tests.unit.services.gateway_fakes import PROMPT, Gateway, build_gateway

TINY = "tiny"


def _serve_tiny(gw: Gateway, namespace: str, tiny_dir: Path) -> Router:
    """Register a prefill and a decode worker of the tiny model in its pool namespace and
    add the model to the gateway (as `build_service` does for --extra-models)."""
    pool = pool_namespace(namespace, TINY)
    registry = Registry(gw.client, Keyspace(pool))
    for role in ("prefill", "decode"):
        wid = f"t{role[0]}0"
        registry.register(WorkerInfo(wid, role, "tm", "tl", f"{wid}:1"))  # type: ignore[arg-type]
    router = Router(gw.client, RouterConfig(namespace=pool))
    router.refresh()
    spec = ModelSpec.from_dir(tiny_dir)
    gw.service.add_model(
        ServedModelSpec(
            TINY, Tokenizer(tiny_dir), spec.max_position_embeddings, spec.vocab_size,
            RedisPlacement(router), Admission(gw.service.config),
        )
    )  # fmt: skip
    return router


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    write_tiny_model("llama3", tmp_path / TINY)
    return tmp_path / TINY


async def _run(gw: Gateway, model: str, max_tokens: int = 4) -> list[gateway_pb2.GenerateResponse]:
    request = build_request(
        PROMPT, RequestOptions(max_tokens=max_tokens, request_id="r", model=model)
    )
    return [msg async for msg in gw.service.stream(gw.service.decode(request))]


def _nothing_held(gw: Gateway, tiny: Router) -> None:
    assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
    for router in (gw.router, tiny):
        assert {r: router.ledger.snapshot(r).counts for r in ("prefill", "decode")} == {
            "prefill": {}, "decode": {},
        }  # fmt: skip


def test_each_model_goes_to_its_own_workers_with_its_own_tokenizer(
    client: redis.Redis, namespace: str, model_dir: Path, tiny_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        tiny = _serve_tiny(gw, namespace, tiny_dir)
        await _run(gw, TINY)
        await _run(gw, "")  # no name: the primary model
        await _run(gw, gw.service.models.primary.name)
        assert gw.cluster.prefills == ["tp0:1", "p0:1", "p0:1"]
        assert [d.address for d in gw.cluster.decodes] == ["td0:1", "d0:1", "d0:1"]
        prompts = [list(d.request.prompt_token_ids) for d in gw.cluster.decodes]
        assert prompts[0] == Tokenizer(tiny_dir).encode(PROMPT)
        assert prompts[1] == prompts[2] == Tokenizer(model_dir).encode(PROMPT)
        assert prompts[0] != prompts[1]
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        _nothing_held(gw, tiny)

    asyncio.run(scenario())


def test_each_model_has_its_own_limits_and_unknown_names_are_listed(
    client: redis.Redis, namespace: str, model_dir: Path, tiny_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        tiny = _serve_tiny(gw, namespace, tiny_dir)
        limit = ModelSpec.from_dir(tiny_dir).max_position_embeddings
        with pytest.raises(InvalidRequestError, match=f"must be <= {limit}"):
            await _run(gw, TINY, max_tokens=limit)
        with pytest.raises(UnknownModelError) as unknown:
            await _run(gw, "other")
        assert "'other' is not served here" in str(unknown.value)
        assert f"{gw.service.models.primary.name!r}, {TINY!r}" in str(unknown.value)
        assert [m.name for m in gw.service.models] == [gw.service.models.primary.name, TINY]
        assert gw.cluster.prefills == []
        _nothing_held(gw, tiny)

    asyncio.run(scenario())


def test_request_metrics_are_counted_by_model(
    client: redis.Redis, namespace: str, model_dir: Path, tiny_dir: Path
) -> None:
    """Each model's requests in its own series; a request for a name nobody serves under
    `-`, not under the name it sent."""

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir)
        tiny = _serve_tiny(gw, namespace, tiny_dir)
        metrics = GatewayMetrics(CollectorRegistry(), slo_ttft_s=60.0, slo_itl_s=60.0)
        gw.service.telemetry = GatewayTelemetry(Tracing.disabled("test"), metrics)
        for model in (TINY, TINY, ""):
            await _run(gw, model)
        with pytest.raises(UnknownModelError):
            await _run(gw, "other")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() for s in family.samples
        }  # fmt: skip
        primary = gw.service.models.primary.name

        def count(name: str, **labels: str) -> float:
            return samples.get((name, tuple(sorted(labels.items()))), 0.0)

        assert count("pdserve_time_to_first_token_seconds_count", model=TINY) == 2
        assert count("pdserve_time_to_first_token_seconds_count", model=primary) == 1
        assert count("pdserve_goodput_requests_total", model=TINY) == 2
        assert count("pdserve_active_streams", model=TINY) == 0
        assert count("pdserve_request_errors_total", code="NOT_FOUND", model="-") == 1
        assert not any(("model", "other") in labels for _, labels in samples)
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        _nothing_held(gw, tiny)

    asyncio.run(scenario())


def test_model_names_and_lists_are_checked() -> None:
    assert pool_namespace("ns") == "ns"
    assert pool_namespace("ns", "a") == "ns/a"
    assert pool_namespace("ns", "a", "v2") == "ns/a@v2"
    with pytest.raises(ValueError, match="served_model_name must not contain '/'"):
        pool_namespace("ns", "a/b")
    with pytest.raises(ValueError, match="model_version needs served_model_name"):
        pool_namespace("ns", "", "v1")
    assert extra_model_dirs(" a=/m/a , b=/m/b ") == {"a": "/m/a", "b": "/m/b"}
    with pytest.raises(ValueError, match="'a' is not NAME=MODEL_DIR"):
        extra_model_dirs("a")
    with pytest.raises(ValueError, match="'a' is listed twice"):
        extra_model_dirs("a=/x,a=/y")
    with pytest.raises(ValueError, match="extra_models needs placement redis"):
        GatewayConfig(extra_models="a=/x", decode_workers="d:1")
    with pytest.raises(ValueError, match="names --model already"):
        GatewayConfig(placement="redis", served_model_name="a", extra_models="a=/x")
