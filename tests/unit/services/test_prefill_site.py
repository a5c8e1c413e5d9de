"""Conditional disaggregation: the site policy's choice by uncached tokens and live queues,
the queue lengths it reads from the workers' signals, and the gateway acting on it (on
real Redis in front of fake workers: a local request makes no Prefill call and gives the
prefill worker's load lease back at once; a long one takes the hop). Leak-checked."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from engine.stats import ClassCounts
from services.common.role import Role
from services.gateway.flow.capacity import Capacity
from services.gateway.flow.prefill_site import BUSY_FACTOR, PrefillSite, SitePolicy, SiteReason
from services.gateway.flow.worker_loads import NoLoads
from tests.unit.services.gateway_fakes import (
    DECODE_TOKENS,
    FIRST_TOKEN,
    Client,
    assert_nothing_held,
    build_gateway,
    only_record,
    prompt_tokens,
    start_request,
    until,
)
from tests.unit.services.test_capacity import signal

LOCAL, HOP = PrefillSite.LOCAL, PrefillSite.DISAGGREGATED


class _Loads(NoLoads):
    """Recorded loads: queue seconds and streams, by worker."""

    def __init__(self, queues: dict[str, float], streams: dict[str, int] | None = None) -> None:
        self.queues, self.counts = queues, streams or {}

    def queue_s(self, worker_id: str) -> float:
        return self.queues.get(worker_id, 0.0)

    def streams(self, worker_id: str) -> int:
        return self.counts.get(worker_id, 0)


def _policy(queues: dict[str, float] | None = None, busy_s: float = 1.0) -> SitePolicy:
    return SitePolicy(512, busy_s, _Loads(queues or {}))


@pytest.mark.parametrize(
    ("prompt", "cached", "queues", "site", "reason"),
    [
        (300, 0, {}, LOCAL, SiteReason.SHORT_PROMPT),
        (300, 0, {"d": 2.0, "p": 0.5}, HOP, SiteReason.DECODE_BUSY),
        (300, 0, {"d": 2.0, "p": 3.0}, LOCAL, SiteReason.SHORT_PROMPT),  # prefill is worse
        (512, 0, {}, LOCAL, SiteReason.SHORT_PROMPT),
        (513, 0, {}, HOP, SiteReason.LONG_PROMPT),
        (900, 400, {}, LOCAL, SiteReason.CACHED_PREFIX),
        (900, 300, {}, HOP, SiteReason.LONG_PROMPT),
        (1500, 0, {"p": 3.0, "d": 0.5}, LOCAL, SiteReason.PREFILL_BUSY),
        (1500, 0, {"p": 3.0, "d": 4.0}, HOP, SiteReason.LONG_PROMPT),  # decode is worse
        (1500, 0, {"p": 0.9}, HOP, SiteReason.LONG_PROMPT),  # not busy enough
        (BUSY_FACTOR * 512 + 1, 0, {"p": 30.0}, HOP, SiteReason.LONG_PROMPT),  # too long
    ],
)
def test_the_site_follows_uncached_tokens_and_the_queues(
    prompt: int, cached: int, queues: dict[str, float], site: PrefillSite, reason: SiteReason
) -> None:
    choice = _policy(queues).choose(prompt, cached, "p", "d")
    assert (choice.site, choice.reason) == (site, reason)
    assert choice.uncached_tokens == prompt - cached


def test_zero_thresholds_turn_the_decision_off() -> None:
    always = SitePolicy(0, 1.0).choose(10, 0, "p", "d")
    assert (always.site, always.reason) == (HOP, SiteReason.ALWAYS)
    no_busy = _policy({"p": 100.0}, busy_s=0.0).choose(1500, 0, "p", "d")
    assert no_busy.reason is SiteReason.LONG_PROMPT


def test_queue_seconds_come_from_each_workers_signal() -> None:
    cap = Capacity(SitePolicy(512, busy_s=0.0))
    waiting = ClassCounts(standard=1200, critical=300)
    cap.update([
        signal(Role.PREFILL, waiting=waiting, rate=500.0, wid="p0"),
        signal(Role.DECODE, waiting=ClassCounts(standard=100), rate=200.0, wid="d0"),
        signal(Role.DECODE, waiting=waiting, wid="d1"),  # no speed measured yet
    ])  # fmt: skip
    assert cap.queue_s("p0") == pytest.approx(3.0)
    assert cap.queue_s("d0") == pytest.approx(0.5)
    assert cap.queue_s("d1") == 0.0 and cap.queue_s("gone") == 0.0
    # Decode workers prefill too: they are a second prefill site (`local`).
    assert cap.prefill.rate == pytest.approx(500.0) and cap.local.rate == pytest.approx(200.0)
    hop_only = Capacity()
    hop_only.update([signal(Role.PREFILL, rate=500.0), signal(Role.DECODE, rate=200.0)])
    assert hop_only.prefill.rate == pytest.approx(500.0) and hop_only.local.rate == 0.0


def test_a_short_prompt_is_prefilled_by_its_decode_worker(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, local_prefill_max_tokens=512)
        gw.cluster.gates["next_token"].hold()
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(gw.cluster.gates["next_token"].arrived.wait(), 10)
        # Only the decode worker's load is held: the prefill lease went back at once.
        await until(lambda: gw.load_counts() == {"prefill": {}, "decode": {"d0": 1}})
        record = only_record(gw)
        gw.cluster.gates["next_token"].proceed.set()
        await task
        assert gw.cluster.prefills == []
        (call,) = gw.cluster.decodes
        assert not call.request.HasField("kv_handle")
        assert list(call.request.prompt_token_ids) == record.req.prompt
        assert reader.received[0].prefill_worker == "d0"  # it prefilled here
        assert [t for m in reader.received for t in m.token_ids] == list(DECODE_TOKENS)
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_a_prompt_past_the_threshold_takes_the_prefill_hop(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, local_prefill_max_tokens=1)
        assert prompt_tokens(gw) > 1
        reader, task, record = await start_request(gw)
        await task
        assert gw.cluster.prefills == ["p0:1"]
        (call,) = gw.cluster.decodes
        assert call.request.HasField("kv_handle")
        assert [t for m in reader.received for t in m.token_ids] == [FIRST_TOKEN, *DECODE_TOKENS]
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())
