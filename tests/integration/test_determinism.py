"""Deterministic by default, on real processes: greedy and seeded requests get the same
tokens and the same log-probabilities (as floats, bit for bit) sent one at a time and
all at once, through a prefill worker's hand-off and prefilled on the decode worker.
Each prompt is computed in other pieces on each pass: the first pass misses the prefix
caches (but for long_prompt(5), which is long_prompt(8)'s first five sections and hits
its blocks mid-prompt), the second hits them, its prompts beside each other. The suite
runs float32, where `batch_invariant auto` is on (`engine.invariance`); nothing
leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pdserve.v1 import gateway_pb2
from services.cluster.local_cluster import LocalCluster
from services.gateway.client import GatewayClient, RequestOptions, build_request
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster
from tests.prompts import SHORT, long_prompt

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): the invariance it checks holds in float32 only (issue
# 42).
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.FLOAT32)]

TOKENS = 16
GREEDY = RequestOptions(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = RequestOptions(max_tokens=TOKENS, temperature=0.8, seed=1234, ignore_eos=True)
Answer = tuple[tuple[int, ...], tuple[float, ...], str]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = _cluster(num_prefill=1, num_decode=1, local_prefill_max_tokens=512)
    yield c
    c.stop()


#: The requests, greedy then seeded: long_prompt(8) takes the prefill hop (over the
#: cluster's 512-token local limit) on the first pass.
PROMPTS = ((GREEDY, [*SHORT[:3], long_prompt(8), long_prompt(5)]), (SEEDED, SHORT[:3]))
FIRST_SEEDED = len(PROMPTS[0][1])


def _requests() -> list[gateway_pb2.GenerateRequest]:
    out = []
    for options, prompts in PROMPTS:
        for prompt in prompts:
            request = build_request(prompt, options)
            request.sampling.logprobs = 0  # the chosen token's, no alternatives
            out.append(request)
    return out


async def _answer(client: GatewayClient, request: gateway_pb2.GenerateRequest) -> Answer:
    msgs = [m async for m in client.generate(request)]
    tokens = tuple(t for m in msgs for t in m.token_ids)
    logprobs = tuple(lp.chosen.logprob for m in msgs for lp in m.logprobs)
    return tokens, logprobs, msgs[0].prefill_worker


async def _one_at_a_time(address: str) -> list[Answer]:
    async with GatewayClient(address) as client:
        return [await _answer(client, r) for r in _requests()]


async def _all_at_once(address: str) -> list[Answer]:
    async with GatewayClient(address) as client:
        return list(await asyncio.gather(*(_answer(client, r) for r in _requests())))


def test_answers_do_not_depend_on_what_else_runs(cluster: LocalCluster) -> None:
    probe = start_probe(cluster)
    alone = asyncio.run(_one_at_a_time(cluster.gateway_address))
    together = asyncio.run(_all_at_once(cluster.gateway_address))
    for (tokens, logprobs, prefilled_by), again in zip(alone, together, strict=True):
        assert len(tokens) == TOKENS and len(logprobs) == TOKENS
        assert (tokens, logprobs) == again[:2], prefilled_by
    assert {a[2] for a in alone} == {"decode-0", "prefill-0"}  # both paths ran
    assert alone[0][0] != alone[FIRST_SEEDED][0]  # greedy and seeded differ: sampling ran
    assert_cluster_clean(probe)
