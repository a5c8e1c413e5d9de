"""A gateway's router refuses to place while the registered workers' model differs from
its own copy in the parts the gateway uses (tokenizer, chat template, config), naming
them; a difference in the weights alone is not its concern, and workers that publish no
identity pass. On real Redis, through the registry."""

from __future__ import annotations

import dataclasses

import pytest
import redis

from engine.model_identity import IdentityPart, ModelIdentity
from services.common.status import ModelMismatchError, code_for
from services.router.identity_check import GATEWAY_PARTS
from services.router.keyspace import Keyspace
from services.router.placement import RouteQuery
from services.router.registry import Registry
from services.router.router import Router
from services.router.router_config import RouterConfig
from tests.unit.router.conftest import worker

MINE = ModelIdentity(config="c", weights="w", tokenizer="t", chat_template="ct")


def _router(client: redis.Redis, namespace: str, published: ModelIdentity | None) -> Router:
    Registry(client, Keyspace(namespace)).register(worker("m0", identity=published))
    router = Router(client, RouterConfig(namespace=namespace, membership_refresh_s=0.0))
    router.expect_identity(MINE, GATEWAY_PARTS, "this gateway")
    return router


def test_the_registry_keeps_a_workers_identity(client: redis.Redis, namespace: str) -> None:
    registry = Registry(client, Keyspace(namespace))
    registry.register(worker("m0", identity=MINE))
    registry.register(worker("m1"))
    assert [w.identity for w in registry.list()] == [MINE, None]


@pytest.mark.parametrize(
    "published", [MINE, dataclasses.replace(MINE, weights="other"), None],
    ids=["same", "weights_differ", "unpublished"],
)  # fmt: skip
def test_a_matching_model_routes(
    client: redis.Redis, namespace: str, published: ModelIdentity | None
) -> None:
    router = _router(client, namespace, published)
    decision = router.route(RouteQuery("r", [1, 2, 3], "t"))
    assert decision.decode.worker_id == "m0"


def test_a_different_tokenizer_and_template_are_refused_by_name(
    client: redis.Redis, namespace: str
) -> None:
    theirs = dataclasses.replace(MINE, tokenizer="t2", chat_template="ct2")
    router = _router(client, namespace, theirs)
    with pytest.raises(ModelMismatchError) as refused:
        router.route(RouteQuery("r", [1, 2, 3], "t"))
    message = str(refused.value)
    assert IdentityPart.TOKENIZER.value in message and IdentityPart.CHAT_TEMPLATE.value in message
    assert IdentityPart.CONFIG.value not in message and "this gateway" in message
    assert code_for(refused.value).name == "UNAVAILABLE"
    assert router.stats.decisions == 0
