"""Corrupt KV at the hand-off, end to end: a real 1 prefill + 1 decode cluster whose
decode worker flips a bit in every block read (`PDSERVE_TEST_KV_BIT_FLIPS=1`, so the
re-read fails too). Every import fails its checksums with DATA_LOSS, the gateway has
the decode worker compute the prompt itself, and the client gets the tokens a single
engine gives, with no error and nothing leaked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import cast

import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.fault import ENV
from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from tests.conftest import EngineFactory
from tests.integration.cluster_drills import pool
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster, _collect
from tests.prompts import long_prompt

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): each corrupted import ends in the engine's tokens; its
# prompts are short enough to go local otherwise.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.FLOAT32, Pin.PREFILL_HOP)]

PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def corrupting() -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV, "1")  # the workers inherit it; only a decode worker imports
        cluster = _cluster(num_prefill=1, num_decode=1)
    yield cluster
    cluster.stop()


def test_corrupt_kv_is_computed_again_and_the_answer_is_right(
    corrupting: LocalCluster, make_engine: EngineFactory
) -> None:
    reference: LLMEngine = make_engine(num_kv_blocks=200)
    prompts = [long_prompt(3 + i) for i in range(3)]
    probe = start_probe(corrupting)
    for prompt in prompts:
        got = asyncio.run(_collect(corrupting.gateway_address, prompt=prompt, max_tokens=8))
        msgs = cast(list[gateway_pb2.GenerateResponse], got)
        (expected,) = reference.generate([reference.tokenizer.encode(prompt)], PARAMS)
        assert [t for m in msgs for t in m.token_ids] == expected
        assert msgs[-1].finished
    (decode,) = pool(corrupting, "decode")
    assert decode.metrics_port is not None
    lost = scrape(decode.metrics_port).get("pdserve_kv_checksum_failures_total{outcome=lost}")
    assert lost == len(prompts)
    gateway_port = corrupting.gateways[0].metrics_port
    assert gateway_port is not None
    moves = scrape(gateway_port).get("pdserve_stream_migrations_total{outcome=reprefill}")
    assert moves == len(prompts)
    assert_cluster_clean(probe)
