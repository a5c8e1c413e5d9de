"""Elastic roles: when the prefill worker runs a request whole (`SitePolicy` on recorded
signals, stale and missing ones included), the loads it reads (`WorkerLoads`), and the
gateway acting on it (real Redis, fake workers: no Prefill call, the Decode call goes to
the prefill worker, the decode worker's load lease goes back at once). Leak-checked."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from engine.stats import ClassCounts
from services.common.role import Role
from services.gateway.flow.prefill_site import PrefillSite, SitePolicy, SiteReason
from services.gateway.flow.worker_loads import RECENT_WINDOW_S, WorkerLoads
from services.router.worker_signal import IDLE_QUEUE_S, MIN_DECODE_STREAMS, WorkerSignal
from tests.unit.services.gateway_fakes import (
    DECODE_TOKENS,
    Client,
    assert_nothing_held,
    build_gateway,
    only_record,
    until,
)
from tests.unit.services.test_capacity import signal

WHOLE = PrefillSite.PREFILL_WORKER
RATE = 1000.0  # prompt tokens per second of prefill, both workers


def _signal(
    role: Role, wid: str, *, running: int = 0, queued: int = 0, age: float = 0.0
) -> WorkerSignal:
    waiting = ClassCounts(standard=queued)
    return replace(signal(role, waiting=waiting, rate=RATE, wid=wid, age=age), running=running)


def _loads(p_running: int = 0, d_running: int = 4, p_queued: int = 0) -> WorkerLoads:
    loads = WorkerLoads()
    loads.update(
        [_signal(Role.PREFILL, "p", running=p_running, queued=p_queued),
         _signal(Role.DECODE, "d", running=d_running)],
        now=100.0,
    )  # fmt: skip
    return loads


def _choose(
    loads: WorkerLoads, prompt: int = 300, **policy: object
) -> tuple[PrefillSite, SiteReason]:
    settings: dict[str, object] = {"elastic": True, **policy}
    choice = SitePolicy(512, 1.0, loads, **settings).choose(prompt, 0, "p", "d")  # type: ignore[arg-type]
    return choice.site, choice.reason


def test_an_idle_prefill_worker_takes_a_short_request_whole_from_a_loaded_decode_worker() -> None:
    assert _choose(_loads()) == (WHOLE, SiteReason.DECODE_LOADED)
    # Anything longer than a decode worker may prefill keeps the split.
    assert _choose(_loads(), prompt=4 * 512 + 1)[0] is PrefillSite.DISAGGREGATED


@pytest.mark.parametrize(
    ("loads", "why"),
    [
        (_loads(p_running=4, d_running=4), "the prefill worker carries as many streams"),
        (_loads(d_running=MIN_DECODE_STREAMS - 1), "the decode worker is nearly idle"),
        (_loads(p_queued=int(IDLE_QUEUE_S * RATE) + 1), "the prefill worker has a queue"),
        (WorkerLoads(), "no signals at all: today's behaviour"),
    ],
)
def test_otherwise_the_request_goes_where_conditional_disaggregation_says(
    loads: WorkerLoads, why: str
) -> None:
    assert _choose(loads) == (PrefillSite.LOCAL, SiteReason.SHORT_PROMPT), why


def test_elastic_off_or_every_prompt_hopping_never_runs_a_request_whole() -> None:
    assert _choose(_loads(), elastic=False)[0] is PrefillSite.LOCAL
    always = SitePolicy(0, 1.0, _loads(), elastic=True).choose(300, 0, "p", "d")
    assert (always.site, always.reason) == (PrefillSite.DISAGGREGATED, SiteReason.ALWAYS)


def test_a_missing_decode_signal_falls_back() -> None:
    """A worker whose signal expired is unknown (no streams): nothing moves to the
    prefill worker on a count the gateway cannot see."""
    loads = _loads()
    loads.update([_signal(Role.PREFILL, "p")], now=101.0)  # the decode worker's expired
    assert _choose(loads)[0] is PrefillSite.LOCAL


def test_a_prefill_worker_sent_a_long_prompt_lately_keeps_to_prefill() -> None:
    """Its queue may be empty now, between two long prompts; a stream placed there would
    wait through the next one's prefill chunks."""
    loads = _loads()
    policy = SitePolicy(512, 1.0, loads, elastic=True)
    long = policy.choose(4 * 512 + 1, 0, "p", "d")
    assert (long.site, long.reason) == (PrefillSite.DISAGGREGATED, SiteReason.LONG_PROMPT)
    assert loads.long_prompt_lately("p") and not loads.long_prompt_lately("d")
    assert _choose(loads)[0] is PrefillSite.LOCAL
    later = time.monotonic() + RECENT_WINDOW_S
    assert not loads.long_prompt_lately("p", now=later)
    loads.update([_signal(Role.PREFILL, "p"), _signal(Role.DECODE, "d", running=4)], now=later)
    assert _choose(loads)[0] is WHOLE


def test_a_prefill_queue_no_longer_than_the_decode_workers_does_not_stop_it() -> None:
    """Under chat load both workers prefill their own requests: the two queues are alike."""
    queued = int(3 * IDLE_QUEUE_S * RATE)
    loads = WorkerLoads()
    loads.update([_signal(Role.PREFILL, "p", running=2, queued=queued),
                  _signal(Role.DECODE, "d", running=5, queued=queued)], now=100.0)  # fmt: skip
    assert _choose(loads)[0] is WHOLE


def test_a_burst_inside_one_signal_interval_splits_between_the_workers() -> None:
    loads = _loads(p_running=0, d_running=2)
    policy = SitePolicy(512, 1.0, loads, elastic=True)
    sites = [policy.choose(300, 0, "p", "d").site for _ in range(10)]
    assert abs(loads.streams("p") - loads.streams("d")) <= 1
    assert loads.streams("p") + loads.streams("d") == 12
    assert sites.count(WHOLE) == loads.streams("p") >= 4
    # The next signal counts those streams itself: the gateway's own tally restarts.
    later = time.monotonic()  # the placements' clock
    loads.update([_signal(Role.PREFILL, "p", running=6), _signal(Role.DECODE, "d", running=6)],
                 now=later)  # fmt: skip
    assert (loads.streams("p"), loads.streams("d")) == (6, 6)


def test_placements_after_a_signal_was_taken_still_count() -> None:
    """A signal published before a placement (its age says so) does not yet count it."""
    loads = _loads(d_running=2)
    loads.placed("d", now=100.5)
    loads.update([_signal(Role.PREFILL, "p"), _signal(Role.DECODE, "d", running=2, age=0.6)],
                 now=101.0)  # taken at 100.4: before the placement  # fmt: skip
    assert loads.streams("d") == 3


def test_a_failed_prefill_takes_its_count_back_so_a_retry_counts_once() -> None:
    loads = _loads(d_running=2)
    policy = SitePolicy(512, 1.0, loads)
    first = policy.choose(4 * 512 + 1, 0, "p", "d")  # a long prompt: it takes the hop
    assert (first.site, first.placed_on, loads.streams("d")) == (PrefillSite.DISAGGREGATED, "d", 3)
    policy.withdraw(first)  # its prefill failed; the gateway places it again
    retry = policy.choose(4 * 512 + 1, 0, "p", "d")
    assert loads.streams("d") == 3
    # A signal taken after the placement counts the stream itself: nothing more to take.
    assert retry.placed_mark is not None
    loads.update([_signal(Role.PREFILL, "p"), _signal(Role.DECODE, "d", running=3)],
                 now=retry.placed_mark + 1.0)  # fmt: skip
    policy.withdraw(retry)
    assert loads.streams("d") == 3
    ghost = policy.choose(4 * 512 + 1, 0, "p", "gone")  # no signal: nothing counted
    assert ghost.placed_mark is None
    policy.withdraw(ghost)
    assert loads.streams("gone") == 0


def test_a_stream_whose_prefill_was_retried_is_counted_once_on_its_decode_worker(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, prefill_workers=2)
        capacity = gw.service.models.primary.admission.capacity
        capacity.update([_signal(Role.PREFILL, "p0"), _signal(Role.PREFILL, "p1"),
                         _signal(Role.DECODE, "d0")])  # fmt: skip
        gw.cluster.unreachable_first = True  # the first Prefill call fails: retried
        gw.cluster.gates["next_token"].hold()
        task = asyncio.create_task(Client(gw).run())
        await asyncio.wait_for(gw.cluster.gates["next_token"].arrived.wait(), 10)
        assert len(gw.cluster.prefills) == 2  # both attempts placed the stream on d0
        assert capacity.loads.streams("d0") == 1
        record = only_record(gw)
        gw.cluster.gates["next_token"].proceed.set()
        await task
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())


def test_the_gateway_sends_the_request_whole_to_the_prefill_worker(
    client: redis.Redis, namespace: str, model_dir: Path
) -> None:
    async def scenario() -> None:
        gw = build_gateway(client, namespace, model_dir, local_prefill_max_tokens=512)
        capacity = gw.service.models.primary.admission.capacity
        capacity.update([_signal(Role.PREFILL, "p0"), _signal(Role.DECODE, "d0", running=5)])
        gw.cluster.gates["next_token"].hold()
        reader = Client(gw)
        task = asyncio.create_task(reader.run())
        await asyncio.wait_for(gw.cluster.gates["next_token"].arrived.wait(), 10)
        # Only the prefill worker's load is held: the decode lease went back at once.
        await until(lambda: gw.load_counts() == {"prefill": {"p0": 1}, "decode": {}})
        record = only_record(gw)
        gw.cluster.gates["next_token"].proceed.set()
        await task
        assert gw.cluster.prefills == []
        (call,) = gw.cluster.decodes
        assert call.address == "p0:1" and not call.request.HasField("kv_handle")
        assert reader.received[0].prefill_worker == reader.received[0].decode_worker == "p0"
        assert [t for m in reader.received for t in m.token_ids] == list(DECODE_TOKENS)
        await assert_nothing_held(gw, record)

    asyncio.run(scenario())
