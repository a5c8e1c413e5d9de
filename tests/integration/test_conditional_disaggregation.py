"""Conditional disaggregation on real processes (1 prefill + 1 decode worker, the gateway's
decision on at 512 uncached tokens): a short prompt is prefilled by the decode worker, a
long one takes the prefill hop and its KV moves over NIXL, both streams equal one
engine's greedy output, the gateway counts each choice by mode and reason, and nothing
leaks. The workers run speculative decoding (`on`): the decode worker verifies drafts
through both paths and the streams are still the plain engine's, token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import cast

import pytest

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.common.metrics import scrape
from tests.conftest import EngineFactory
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster, _collect
from tests.prompts import SHORT, long_prompt

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): streams equal a batched float32 engine's output token
# for token.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.FLOAT32)]

DECISIONS = "pdserve_disaggregation_decisions_total"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = _cluster(num_prefill=1, num_decode=1, local_prefill_max_tokens=512,
                 speculative_decoding="on")  # fmt: skip
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(make_engine: EngineFactory) -> LLMEngine:
    return make_engine(num_kv_blocks=200)


def _decisions(cluster: LocalCluster) -> dict[str, float]:
    port = cluster.gateways[0].metrics_port
    assert port is not None
    return {k: v for k, v in scrape(port).items() if k.startswith(DECISIONS)}


def short_and_long_streams(
    cluster: LocalCluster, reference: LLMEngine, local_max: int, max_tokens: int
) -> dict[str, list[gateway_pb2.GenerateResponse]]:
    """A short prompt (at most `local_max` tokens) and a long one (over it, at most 4x),
    one after the other through the gateway; asserts that each stream is `reference`'s
    greedy output and finished. Returns the streams' messages by "short" and "long"."""
    short, long = SHORT[2], long_prompt(8)
    lengths = [len(reference.tokenizer.encode(p)) for p in (short, long)]
    assert lengths[0] <= local_max < lengths[1] <= 4 * local_max
    sent = {}
    for name, prompt in (("short", short), ("long", long)):
        got = asyncio.run(_collect(cluster.gateway_address, prompt=prompt, max_tokens=max_tokens))
        sent[name] = cast(list[gateway_pb2.GenerateResponse], got)
    expected = reference.generate(
        [reference.tokenizer.encode(p) for p in (short, long)],
        SamplingParams(max_tokens=max_tokens),
    )
    for msgs, want in zip(sent.values(), expected, strict=True):
        assert [t for m in msgs for t in m.token_ids] == want
        assert msgs[-1].finished
    return sent


def test_short_prompts_prefill_locally_and_long_ones_take_the_hop(
    cluster: LocalCluster, reference: LLMEngine
) -> None:
    probe = start_probe(cluster)
    sent = short_and_long_streams(cluster, reference, local_max=512, max_tokens=12)
    assert sent["short"][0].prefill_worker == "decode-0"  # its decode worker prefilled it
    assert sent["long"][0].prefill_worker == "prefill-0"
    assert len(sent["long"][0].token_ids) == 1  # token 1 came from the prefill worker
    decisions = _decisions(cluster)
    assert decisions[f"{DECISIONS}{{mode=local,reason=short_prompt}}"] == 1
    assert decisions[f"{DECISIONS}{{mode=disaggregated,reason=long_prompt}}"] == 1
    port = next(c.metrics_port for c in cluster.children if c.name == "decode-0")
    assert port is not None
    spec = scrape(port)
    assert spec["pdserve_spec_tokens_total{kind=drafted}"] > 0  # it speculated
    assert_cluster_clean(probe)
