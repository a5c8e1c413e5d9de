"""The cluster users run, on real processes: 1 prefill + 1 decode worker on the product
defaults (no pins, tests/integration/pins.py), so the gateway decides conditional
disaggregation at its default threshold, the workers may change roles, and they compute
in their default dtype, `auto`: bfloat16 on a host with native bf16 (the development and
CI hosts), float32 elsewhere. Checked:
- the workers register a KV layout in the dtype `auto` picks on this host;
- a short prompt is prefilled and decoded by one worker (no hop), a long one takes the
  hop (token 1 from the prefill worker, its KV over NIXL), and each stream is, token for
  token, what one engine in that dtype computes for the prompt alone;
- 12 concurrent requests of both kinds all finish with their lengths;
- nothing leaks.
Under concurrency bf16 tokens may still differ from the lone engine's (issue 42), so the
concurrent round asserts completion, not tokens."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import cast

import pytest
import torch

from engine.engine import LLMEngine
from engine.precision import DType, resolve_dtype
from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry
from tests.conftest import EngineFactory
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster, _collect
from tests.integration.test_conditional_disaggregation import short_and_long_streams
from tests.prompts import SHORT, long_prompt

# Runs beside one other pairable file in make test (tests/conftest.py).
pytestmark = pytest.mark.pairable

#: What the workers' `auto` computes in on this host (bfloat16 where it is native).
AUTO_DTYPE = str(resolve_dtype(DType.AUTO, torch.device("cpu"))).removeprefix("torch.")
GATEWAY_DEFAULT_LOCAL_MAX = 512  # services/gateway/config.py: local_prefill_max_tokens
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # The module names no pins: its children start on the product defaults.
    for pin in Pin:
        assert pin.env_var not in os.environ, pin
    c = _cluster(num_prefill=1, num_decode=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=200, dtype=AUTO_DTYPE)


def test_the_workers_compute_in_their_default_dtype(cluster: LocalCluster) -> None:
    assert cluster.redis is not None
    client, keys = connect(cluster.redis.url, 2.0), Keyspace("pdserve")
    workers = Registry(client, keys).list()
    assert {w.worker_id for w in workers} == {"prefill-0", "decode-0"}
    # The identity every live worker shares, its KV layout in words.
    layout = client.hget(keys.identity, "layout_text")
    assert layout is not None and f"KV {AUTO_DTYPE}" in str(layout), layout


def test_short_prompts_skip_the_hop_long_ones_take_it_and_tokens_are_the_engines(
    cluster: LocalCluster, reference: LLMEngine
) -> None:
    probe = start_probe(cluster)
    sent = short_and_long_streams(cluster, reference, GATEWAY_DEFAULT_LOCAL_MAX, MAX_TOKENS)
    short_at, long_at = _workers(sent["short"]), _workers(sent["long"])
    # One worker prefilled and decoded the short prompt (the decode worker, or the
    # prefill worker serving it whole while idle): no hop.
    assert len(set(short_at)) == 1, short_at
    assert long_at == ("prefill-0", "decode-0")
    assert len(sent["long"][0].token_ids) == 1  # token 1 came from the prefill worker
    assert_cluster_clean(probe)


def _workers(msgs: list[gateway_pb2.GenerateResponse]) -> tuple[str, str]:
    """(prefill worker, decode worker) as the stream's messages name them."""
    prefill = {m.prefill_worker for m in msgs} - {""}
    decode = {m.decode_worker for m in msgs} - {""}
    assert len(prefill) == len(decode) == 1, (prefill, decode)
    return prefill.pop(), decode.pop()


def test_concurrent_requests_of_both_kinds_all_finish(cluster: LocalCluster) -> None:
    probe = start_probe(cluster)
    prompts = [SHORT[i % len(SHORT)] if i % 3 else long_prompt(6 + i % 4) for i in range(12)]

    async def all_of_them() -> list[list[object]]:
        return await asyncio.gather(
            *(
                _collect(cluster.gateway_address, prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                for p in prompts
            )
        )

    for msgs in asyncio.run(all_of_them()):
        stream = cast(list[gateway_pb2.GenerateResponse], msgs)
        assert sum(len(m.token_ids) for m in stream) == MAX_TOKENS
        assert stream[-1].finished
    assert_cluster_clean(probe)
