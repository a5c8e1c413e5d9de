"""Elastic roles on real processes (1 prefill + 1 decode worker, the gateway's defaults,
conditional disaggregation at 512 tokens among them):
under decode-heavy load the prefill worker serves some requests whole, so streams decode
on both workers; every stream equals one float32 engine's greedy output, the gateway
counts the choice, and nothing leaks. With `--elastic-roles false` (the static split) the
same load decodes on the decode worker alone."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import cast

import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from tests.conftest import EngineFactory
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.test_cluster import _cluster, _collect
from tests.prompts import CHAT, SHORT

DECISIONS = "pdserve_disaggregation_decisions_total"
WHOLE = f"{DECISIONS}{{mode=prefill_worker,reason=decode_loaded}}"
STREAMS = 8
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=400)


def _prompts() -> list[str]:
    return (SHORT + CHAT)[:STREAMS]


async def _burst(address: str) -> list[list[gateway_pb2.GenerateResponse]]:
    runs = [_collect(address, prompt=p, max_tokens=MAX_TOKENS) for p in _prompts()]
    return cast(list[list[gateway_pb2.GenerateResponse]], await asyncio.gather(*runs))


def _decoded_on(streams: list[list[gateway_pb2.GenerateResponse]]) -> Counter[str]:
    return Counter(next(m.decode_worker for m in s if m.decode_worker) for s in streams)


def _serve(elastic: bool, reference: LLMEngine) -> tuple[Counter[str], dict[str, float]]:
    """A burst of short streams on a fresh 1P+1D cluster; where they decoded and the
    gateway's decision counts. Each stream is checked against the reference."""
    cluster: LocalCluster = _cluster(
        num_prefill=1, num_decode=1, dtype="float32", local_prefill_max_tokens=512,
        gateway_args="" if elastic else "--elastic-roles false",
    )  # fmt: skip
    try:
        probe = start_probe(cluster)
        asyncio.run(_collect(cluster.gateway_address, prompt=SHORT[0], max_tokens=2))  # warm
        streams = asyncio.run(_burst(cluster.gateway_address))
        want = reference.generate(
            [reference.tokenizer.encode(p) for p in _prompts()],
            SamplingParams(max_tokens=MAX_TOKENS),
        )
        for msgs, tokens in zip(streams, want, strict=True):
            assert [t for m in msgs for t in m.token_ids] == tokens
            assert msgs[-1].finished
        port = cluster.gateways[0].metrics_port
        assert port is not None
        decisions = {k: v for k, v in scrape(port).items() if k.startswith(DECISIONS)}
        assert_cluster_clean(probe)
        return _decoded_on(streams), decisions
    finally:
        cluster.stop()


def test_under_decode_load_both_workers_decode_and_the_tokens_do_not_change(
    reference: LLMEngine,
) -> None:
    on, decisions = _serve(True, reference)
    assert set(on) == {"prefill-0", "decode-0"}, on
    assert on["prefill-0"] == decisions[WHOLE] >= 2
    assert abs(on["prefill-0"] - on["decode-0"]) <= STREAMS // 2  # about even
    static, decisions = _serve(False, reference)
    assert static == Counter({"decode-0": STREAMS}) and WHOLE not in decisions
