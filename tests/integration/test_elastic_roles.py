"""Elastic roles on real processes (1 prefill + 1 decode worker, the gateway's defaults,
conditional disaggregation at 512 tokens among them):
under decode-heavy load the prefill worker serves some requests whole, so streams decode
on both workers; every stream equals one float32 engine's greedy output, the gateway
counts the choice, and nothing leaks. With `--elastic-roles false` (the static split) the
same load decodes on the decode worker alone. Home roles move with the mix: a chat-shaped
burst turns the idle prefill worker into a decode worker, and long prompts queued on the
two decode workers turn one back, with every stream whole and nothing leaked."""

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
from tests.integration.cluster_drills import home_roles
from tests.integration.leak_check import assert_cluster_clean, start_probe
from tests.integration.pins import Pin
from tests.integration.test_cluster import _cluster, _collect
from tests.prompts import CHAT, SHORT, long_prompt

# Pins (tests/integration/pins.py): the placement test counts where streams ran with roles
# held; the role test passes its own window.
pytestmark = pytest.mark.pins(Pin.FIXED_ROLES)

DECISIONS = "pdserve_disaggregation_decisions_total"
WHOLE = f"{DECISIONS}{{mode=prefill_worker,reason=decode_loaded}}"
STREAMS = 8
MAX_TOKENS = 24
ROLE_WINDOW_S = 3.0  # the planner's window in the role-change test
CHANGES = "pdserve_worker_role_changes_total"


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


def _changes(cluster: LocalCluster, worker: str) -> dict[str, float]:
    child = next(c for c in cluster.children if c.name == worker)
    assert child.metrics_port is not None
    return {k: v for k, v in scrape(child.metrics_port).items() if k.startswith(CHANGES)}


async def _gather(address: str, prompts: list[str], max_tokens: int) -> list[list[object]]:
    return list(
        await asyncio.gather(*(_collect(address, prompt=p, max_tokens=max_tokens) for p in prompts))
    )


async def _long_waves(cluster: LocalCluster, deadline_s: float) -> list[list[object]]:
    """Waves of 6 fresh long prompts (no cached prefix) until a worker is registered as
    prefill again or the deadline passes; every response of every wave."""
    done: list[list[object]] = []
    end = asyncio.get_running_loop().time() + deadline_s
    wave = 0
    while "prefill" not in home_roles(cluster).values():
        assert asyncio.get_running_loop().time() < end, home_roles(cluster)
        prompts = [f"Case {wave}-{i}. " + long_prompt(6) for i in range(6)]
        done += await _gather(cluster.gateway_address, prompts, 4)
        wave += 1
    return done


def test_home_roles_follow_the_mix_with_every_stream_whole(reference: LLMEngine) -> None:
    """1P+1D with a 3 s role window. A burst of short streams leaves the prefill worker
    without a prompt to prefill for other workers while the decode worker is loaded: it
    becomes a decode worker, streams running on it go on, and every stream equals the
    float32 reference. Then waves of long prompts queue on the two decode workers until
    one of them becomes a prefill worker again. No request fails; nothing leaks."""
    cluster: LocalCluster = _cluster(
        num_prefill=1, num_decode=1, dtype="float32", local_prefill_max_tokens=512,
        worker_kv_cache_bytes=256 << 20, worker_args=f"--role-window-s {ROLE_WINDOW_S}",
    )  # fmt: skip
    try:
        probe = start_probe(cluster)
        asyncio.run(_collect(cluster.gateway_address, prompt=SHORT[0], max_tokens=2))  # warm
        assert home_roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode"}
        prompts = (SHORT + CHAT)[:STREAMS]
        want = reference.generate(
            [reference.tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=64)
        )
        moved = False
        for _ in range(3):  # each burst lasts several windows on this host
            streams = asyncio.run(_gather(cluster.gateway_address, prompts, 64))
            for msgs, tokens in zip(streams, want, strict=True):
                got = cast(list[gateway_pb2.GenerateResponse], msgs)
                assert [t for m in got for t in m.token_ids] == tokens
                assert got[-1].finished
            if home_roles(cluster)["prefill-0"] == "decode":
                moved = True
                break
        assert moved, home_roles(cluster)
        assert _changes(cluster, "prefill-0") == {
            f"{CHANGES}{{previous=prefill,reason=planner,role=decode}}": 1.0
        }
        waves = asyncio.run(_long_waves(cluster, deadline_s=60.0))
        assert all(cast(gateway_pb2.GenerateResponse, w[-1]).finished for w in waves)
        assert sorted(home_roles(cluster).values()) == ["decode", "prefill"]
        back = {**_changes(cluster, "prefill-0"), **_changes(cluster, "decode-0")}
        assert f"{CHANGES}{{previous=decode,reason=planner,role=prefill}}" in back
        assert_cluster_clean(probe)
    finally:
        cluster.stop()
