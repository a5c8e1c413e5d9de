"""The usage ledger against real Redis: entries round-trip and sum, a write sent twice is
read once, entries wait through an outage (and the oldest go when the queue is full),
old entries are trimmed, close writes the queue; and the per-tenant label bound."""

from __future__ import annotations

import io
import json
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from services.cli.main import main
from services.cli.usage_cmd import parse_time, write_totals
from services.gateway.access.usage_ledger import (
    LedgerConfig,
    UsageEntry,
    UsageLedger,
    UsageOutcome,
    read,
    stream_key,
    totals,
)
from services.gateway.stream.tenant_metrics import (
    OTHER,
    TenantLabels,
    TenantMetrics,
    TenantOutcome,
)
from services.router.embedded_redis import EmbeddedRedis
from services.router.redis_client import connect

QUIET = LedgerConfig(flush_interval_s=3600.0)  # only the test's own flush() writes


def entry(tenant: str, completion: int, *, ended_ms: int = 0, adapter: str = "") -> UsageEntry:
    return UsageEntry(
        tenant=tenant, model="m", adapter=adapter, priority="standard",
        outcome=UsageOutcome.FINISHED, prompt_tokens=10, cached_tokens=4,
        completion_tokens=completion, request_id=f"r-{tenant}-{completion}",
        ended_ms=ended_ms or int(time.time() * 1000),
    )  # fmt: skip


def test_entries_round_trip_and_sum(client: redis.Redis, namespace: str) -> None:
    ledger = UsageLedger(client, namespace, QUIET)
    now = int(time.time() * 1000)
    for e in (entry("a", 5), entry("a", 7, adapter="sql"), entry("b", 3), entry("a", 1)):
        ledger.add(e)
    assert ledger.pending == 4 and ledger.flush()
    assert (ledger.pending, ledger.written) == (0, 4)
    got = list(read(client, namespace, since_ms=now - 1000))
    assert [(e.tenant, e.completion_tokens, e.adapter) for e in got] == [
        ("a", 5, ""), ("a", 7, "sql"), ("b", 3, ""), ("a", 1, ""),
    ]  # fmt: skip
    assert all(e.outcome is UsageOutcome.FINISHED and len(e.id) == 32 for e in got)
    sums = totals(iter(got))
    assert sums[("a", "m", "")].completion_tokens == 6 and sums[("a", "m", "")].requests == 2
    assert sums[("a", "m", "")].prompt_tokens == 20 and sums[("a", "m", "")].cached_tokens == 8
    assert sums[("b", "m", "")].completion_tokens == 3
    # The range is by when requests ended; nothing ended after now + 1 s.
    assert list(read(client, namespace, since_ms=now + 1000)) == []
    assert len(list(read(client, namespace, since_ms=now - 1000, until_ms=now - 500))) == 0
    ledger.close()


def test_a_write_sent_twice_is_read_once(client: redis.Redis, namespace: str) -> None:
    ledger = UsageLedger(client, namespace, QUIET)
    once = entry("a", 5)
    ledger.add(once)
    ledger.flush()
    stored = next(read(client, namespace))
    ledger.add(stored)  # what a retried write whose reply was lost stores again
    ledger.flush()
    assert client.xlen(stream_key(namespace)) == 2
    assert [e.id for e in read(client, namespace)] == [stored.id]
    ledger.close()


def test_entries_wait_through_an_outage_in_order() -> None:
    server = EmbeddedRedis(tcp=True).start()
    c = connect(server.url, timeout_s=0.5)
    try:
        ledger = UsageLedger(c, "ns", LedgerConfig(flush_interval_s=3600.0, max_pending=3))
        server.stop()
        for i in range(1, 5):
            ledger.add(entry("a", i))
        assert not ledger.flush()
        # The queue holds 3: the oldest was dropped, and counted.
        assert (ledger.pending, ledger.dropped, ledger.written) == (3, 1, 0)
        server.start()  # the same port: Redis is back
        assert ledger.flush()
        assert [e.completion_tokens for e in read(c, "ns")] == [2, 3, 4]
        assert (ledger.pending, ledger.written) == (0, 3)
        ledger.close()
    finally:
        c.close()
        server.close()


def test_old_entries_are_trimmed(client: redis.Redis, namespace: str) -> None:
    ledger = UsageLedger(client, namespace, LedgerConfig(retention_s=0.2, flush_interval_s=3600))
    for i in range(300):  # Redis trims whole nodes (100 entries each) with MINID ~
        ledger.add(entry("old", i))
    ledger.flush()
    time.sleep(0.3)
    ledger.add(entry("new", 1))
    ledger.flush()
    assert client.xlen(stream_key(namespace)) <= 101
    assert [e.tenant for e in read(client, namespace)][-1] == "new"
    ledger.close()


def test_close_writes_what_is_queued(client: redis.Redis, namespace: str) -> None:
    ledger = UsageLedger(client, namespace, QUIET)
    ledger.add(entry("a", 9))
    ledger.close()
    assert [e.completion_tokens for e in read(client, namespace)] == [9]


def test_the_writer_thread_flushes_on_its_own(client: redis.Redis, namespace: str) -> None:
    ledger = UsageLedger(client, namespace, LedgerConfig(flush_interval_s=0.05))
    ledger.add(entry("a", 2))
    deadline = time.monotonic() + 5
    while ledger.written == 0:
        assert time.monotonic() < deadline, "the writer never wrote"
        time.sleep(0.01)
    assert [e.completion_tokens for e in read(client, namespace)] == [2]
    ledger.close()


def test_pdserve_usage_formats() -> None:
    now = 1_700_000_000.0
    assert parse_time("90m", now) == int((now - 5400) * 1000)
    assert parse_time("2026-11-30T00:00:00", now) == 1_795_996_800_000  # naive: UTC
    assert parse_time("2026-11-30T01:00:00+01:00", now) == parse_time("2026-11-30T00:00:00", now)
    out = io.StringIO()
    write_totals([entry("a", 5), entry("a", 7)], "json", out)
    assert json.loads(out.getvalue()) == [
        {"tenant": "a", "model": "m", "adapter": "", "requests": 2, "prompt_tokens": 20,
         "cached_tokens": 8, "completion_tokens": 12},
    ]  # fmt: skip
    out = io.StringIO()
    write_totals([entry("b", 1)], "csv", out)
    assert out.getvalue().splitlines() == [
        "tenant,model,adapter,requests,prompt_tokens,cached_tokens,completion_tokens",
        "b,m,,1,10,4,1",
    ]


def test_tenant_labels_are_bounded_and_follow_traffic() -> None:
    now = [0.0]
    labels = TenantLabels(2, window_s=10.0, clock=lambda: now[0])
    # Room for two: the first two tenants get their own label, the third is "other".
    assert [labels.label(t) for t in ("a", "b", "c")] == ["a", "b", OTHER]
    for _ in range(5):
        labels.label("c")
    labels.label("b")
    now[0] = 10.0  # the window ends: c and b were busiest, a drops to "other"
    assert [labels.label(t) for t in ("a", "b", "c")] == [OTHER, "b", "c"]
    assert len({labels.label(f"t{i}") for i in range(100)}) == 1  # every newcomer: other


def test_pdserve_usage_reads_the_ledger(
    client: redis.Redis, redis_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = UsageLedger(client, "cli-ns", QUIET)
    old = int((time.time() - 7200) * 1000)  # ended two hours ago: outside --since 1h
    for e in (entry("a", 5), entry("a", 7), entry("b", 2), entry("a", 100, ended_ms=old)):
        ledger.add(e)
    ledger.close()
    args = ["usage", "--redis-url", redis_server.url, "--namespace", "cli-ns", "--since", "1h"]
    assert main([*args, "--format", "csv"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1:] == ["a,m,,2,20,8,12", "b,m,,1,10,4,2"]
    assert main([*args, "--entries", "--format", "json"]) == 0
    assert [e["completion_tokens"] for e in json.loads(capsys.readouterr().out)] == [5, 7, 2]
    assert main([*args[:-1], "yesterday"]) == 2  # a clear error, not a traceback
    assert "neither an ISO time nor a span ago" in capsys.readouterr().err


def test_a_redis_that_refuses_writes_keeps_them_queued(client: redis.Redis, namespace: str) -> None:
    """Not only an outage: a key of the wrong type (as a full or read-only Redis would)
    refuses the write; the entries wait, and go once it takes writes again."""
    ledger = UsageLedger(client, namespace, LedgerConfig(flush_interval_s=3600.0, chunk=2))
    client.set(stream_key(namespace), "not a stream")
    for i in range(5):
        ledger.add(entry("a", i))
    assert not ledger.flush() and ledger.pending == 5
    client.delete(stream_key(namespace))
    assert ledger.flush()  # in transactions of 2, 2 and 1
    assert [e.completion_tokens for e in read(client, namespace)] == [0, 1, 2, 3, 4]
    ledger.close()


def test_the_stream_is_capped_at_max_entries(client: redis.Redis, namespace: str) -> None:
    ledger = UsageLedger(client, namespace, LedgerConfig(flush_interval_s=3600.0, max_entries=100))
    for i in range(450):
        ledger.add(entry("a", i))
    ledger.flush()
    # Trimming is approximate (whole nodes of 100): well under what was written.
    assert client.xlen(stream_key(namespace)) <= 200
    assert list(read(client, namespace))[-1].completion_tokens == 449
    ledger.close()


def test_a_tenant_leaving_the_top_takes_its_series_with_it() -> None:
    now = [0.0]
    registry = CollectorRegistry()
    metrics = TenantMetrics(registry, 1, TenantLabels(1, window_s=10.0, clock=lambda: now[0]))
    metrics.finished("a", "standard", True, False, (10, 2, 5))
    metrics.ended("b", "standard", TenantOutcome.REFUSED)  # no room: "other"
    for _ in range(3):
        metrics.ended("b", "standard", TenantOutcome.CANCELLED)

    def tenants() -> set[str]:
        return {s.labels["tenant"] for m in registry.collect() for s in m.samples
                if s.name.startswith("pdserve_tenant_") and s.name.endswith("_total")}  # fmt: skip

    assert tenants() == {"a", OTHER}
    now[0] = 10.0  # b was busier: it takes the one place, and a's series go
    metrics.ended("b", "critical", TenantOutcome.FAILED)
    assert tenants() == {"b", OTHER}
    failed = {"tenant": "b", "priority": "critical", "outcome": "failed"}
    assert registry.get_sample_value("pdserve_tenant_requests_total", failed) == 1.0
