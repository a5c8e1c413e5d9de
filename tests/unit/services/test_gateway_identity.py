"""The gateway refuses to serve for workers whose tokenizer or chat template is not its
own (it would send them token ids their model reads differently): UNAVAILABLE naming
what differs, nothing held afterwards; a model that differs in its weights alone is the
workers' business. Real Redis and registry, fake workers."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import redis

from engine.model_identity import IdentityPart
from engine.model_spec import ModelSpec
from services.common.status import ModelMismatchError, code_for
from services.gateway.stream.record_book import Resource
from tests.unit.services.gateway_fakes import DECODE_TOKENS, FIRST_TOKEN, Client, build_gateway


def test_workers_with_another_tokenizer_are_refused_by_name(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    mine = ModelSpec.from_dir(model_dir).identity
    assert mine is not None
    theirs = dataclasses.replace(mine, tokenizer="0" * 32)

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, worker_identity=theirs)
        with pytest.raises(ModelMismatchError) as refused:
            await Client(gw).run()
        assert IdentityPart.TOKENIZER.value in str(refused.value)
        assert code_for(refused.value).name == "UNAVAILABLE"
        assert gw.cluster.prefills == [] and gw.cluster.decodes == []
        await gw.service.stubs.cleanups.close(timeout_s=10.0)
        assert gw.service.book.counts() == dict.fromkeys(Resource, 0)
        assert gw.load_counts() == {"prefill": {}, "decode": {}}

    asyncio.run(scenario())


def test_workers_whose_weights_alone_differ_are_served(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    mine = ModelSpec.from_dir(model_dir).identity
    assert mine is not None
    theirs = dataclasses.replace(mine, weights="0" * 32)

    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, worker_identity=theirs)
        reader = Client(gw)
        await reader.run()
        assert [t for m in reader.received for t in m.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]

    asyncio.run(scenario())
