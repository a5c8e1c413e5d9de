"""The usage ledger: one durable entry per served request, for billing and audits.

Lifecycle: the gateway builds one `UsageLedger` on its Redis at start (none without a
Redis, or with `--usage-ledger false`). When a request that reached a worker ends,
however it ends, its record's cleanup calls `add(entry)` with the tokens the request's
`usage` says, or would have said had the client read to its end: prompt tokens, the
prompt tokens served from a prefix cache, and completion tokens handed towards the
client (every fork's; a migrated stream's once). `add` only queues. A writer thread
appends the queue to the Redis Stream `<namespace>:usage` every `flush_interval_s`, in
MULTI/EXEC transactions of `chunk` entries (the Redis is the cluster's: one write never
holds it long), and trims entries older than the retention (`XADD ... MINID ~`) and
beyond `max_entries` (`XTRIM MAXLEN ~`). `close()` writes what is queued before the
gateway exits.

Why a stream: every gateway replica appends to one log, which any number of readers
replay from any point (`read`, `pdserve usage`, or a billing exporter's own consumer
group) without a schema in Redis.

No entry is lost to a Redis outage shorter than the queue: entries wait (up to
`max_pending`, then the oldest are dropped, counted and logged) and go out when Redis
takes writes again; a Redis that refuses them (read-only, out of memory, no permission)
is treated the same way. A write whose reply was lost is sent again, so an entry may be stored
twice; each carries a unique `id`, and `read` keeps the first of each.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from typing import NamedTuple, cast

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

SCHEMA = "1"  # the `v` field of each entry: readers refuse a version they do not know
READ_PAGE = 1000  # entries per XRANGE while reading
# Stream ids are Redis's clock, `ended_ms` the gateway's: reading starts this much before
# `since`, so an entry from a gateway whose clock runs ahead is still found.
CLOCK_SLACK_MS = 10 * 60 * 1000
# A write sent twice is stored twice within seconds: dedupe over this many recent ids.
DEDUPE_WINDOW = 100_000


class UsageOutcome(enum.Enum):
    """How a served request ended."""

    FINISHED = "finished"  # its last message was made (usage in it); the client may not
    # have read it (one that stopped reading is disconnected after that)
    CANCELLED = "cancelled"  # the client went away first
    FAILED = "failed"  # an error status ended it


@dataclass(frozen=True)
class UsageEntry:
    """One served request's usage. `ended_ms`: Unix time (ms) it ended at the gateway;
    `adapter`: the LoRA adapter it named ("" for the base model)."""

    tenant: str
    model: str
    adapter: str
    priority: str
    outcome: UsageOutcome
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    request_id: str
    ended_ms: int
    id: str = ""  # unique per entry: a write sent twice is read once

    def fields(self) -> dict[str, str]:
        """The entry as the stream stores it (every value a string)."""
        out = {k: str(v) for k, v in asdict(self).items()}
        out["outcome"] = self.outcome.value
        out["v"] = SCHEMA
        return out

    @classmethod
    def parse(cls, stored: dict[str, str]) -> UsageEntry:
        """The entry a stream message holds; ValueError for another schema version."""
        if stored.get("v") != SCHEMA:
            raise ValueError(f"usage entry schema {stored.get('v')!r}: this reader knows {SCHEMA}")
        ints = {"prompt_tokens", "cached_tokens", "completion_tokens", "ended_ms"}
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = stored[f.name]
            values[f.name] = int(raw) if f.name in ints else raw
        values["outcome"] = UsageOutcome(stored["outcome"])
        return cls(**values)  # type: ignore[arg-type]


def stream_key(namespace: str) -> str:
    return f"{namespace}:usage"


@dataclass(frozen=True)
class LedgerConfig:
    """How the gateway keeps its ledger."""

    retention_s: float = 86400.0  # entries older than this are trimmed
    max_entries: int = 2_000_000  # and the oldest beyond this many (about 340 MB)
    flush_interval_s: float = 0.5  # the longest an entry waits in the queue while Redis is up
    max_pending: int = 100_000  # queued entries kept through an outage
    chunk: int = 500  # entries per transaction: Redis is shared, so no long write blocks it

    def __post_init__(self) -> None:
        if min(self.retention_s, self.flush_interval_s) <= 0:
            raise ValueError("usage ledger: retention_s and flush_interval_s must be > 0")
        if min(self.max_entries, self.max_pending, self.chunk) < 1:
            raise ValueError("usage ledger: max_entries, max_pending and chunk must be >= 1")


class LedgerCounts(NamedTuple):
    """A ledger's queue length and what it wrote and dropped since it started."""

    pending: int
    written: int
    dropped: int


class UsageLedger:
    """Thread-safe `add`; one writer thread per ledger.

    The queue's head, `_in_flight` entries long, is being written; a full queue drops
    the oldest entry behind it (or, with the whole queue in flight, the newcomer), so a
    written entry is never counted as dropped."""

    def __init__(self, client: redis.Redis, namespace: str, config: LedgerConfig) -> None:
        self.client = client
        self.key = stream_key(namespace)
        self.config = config
        self._pending: collections.deque[UsageEntry] = collections.deque()
        self._in_flight = 0
        self._wake = threading.Condition()
        self._flushing = threading.Lock()  # one write at a time: the writer's or a caller's
        self._closed = False
        self._down = False
        self.written = 0  # entries stored
        self.dropped = 0  # entries dropped from a full queue (an outage longer than it)
        self._writer = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._writer.start()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def counts(self) -> LedgerCounts:
        return LedgerCounts(self.pending, self.written, self.dropped)

    def add(self, entry: UsageEntry) -> None:
        """Queue `entry` (with a fresh `id` when it has none); never blocks on Redis."""
        if not entry.id:
            entry = replace(entry, id=uuid.uuid4().hex)
        with self._wake:
            self._pending.append(entry)
            if len(self._pending) > self.config.max_pending:
                if len(self._pending) - 1 > self._in_flight:
                    del self._pending[self._in_flight]  # the oldest not being written
                else:
                    self._pending.pop()  # everything older is being written: the newcomer
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.error("usage ledger queue full: %d entries dropped so far", self.dropped)

    def flush(self) -> bool:
        """Write every queued entry now, `chunk` per transaction; False when Redis did not
        take them all (what it did not take stays queued). The writer thread calls this;
        tests and `close` may too."""
        with self._flushing:
            while True:
                with self._wake:
                    self._in_flight = min(self.config.chunk, len(self._pending))
                    batch = [self._pending[i] for i in range(self._in_flight)]
                if not batch:
                    return True
                written = self._write_chunk(batch)
                with self._wake:
                    if written:
                        for _ in batch:
                            self._pending.popleft()
                        self.written += len(batch)
                    self._in_flight = 0
                if not written:
                    return False

    def _write_chunk(self, batch: list[UsageEntry]) -> bool:
        """One transaction; False (logged once per outage) when Redis refused it."""
        try:
            self._write(batch)
        except (redis.RedisError, OSError) as exc:  # down, read-only, full, no permission
            if not self._down:
                log.warning("usage ledger: Redis did not take a write (%s); %d entries wait",
                            exc, self.pending)  # fmt: skip
            self._down = True
            return False
        if self._down:
            log.warning("usage ledger: Redis takes writes again; queued entries follow")
        self._down = False
        return True

    def _write(self, batch: list[UsageEntry]) -> None:
        oldest_ms = int((time.time() - self.config.retention_s) * 1000)
        pipe = self.client.pipeline(transaction=True)
        for entry in batch:
            pipe.xadd(self.key, entry.fields(), minid=oldest_ms, approximate=True)  # type: ignore[arg-type]
        pipe.xtrim(self.key, maxlen=self.config.max_entries, approximate=True)
        pipe.execute()

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._closed:
                    return
                self._wake.wait(self.config.flush_interval_s)
            try:
                self.flush()
            except Exception:  # a bug must not end the writer: entries would pile up
                log.exception("usage ledger: write failed; trying again")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the writer, then write the queue, trying for up to `timeout_s` after the
        writer stopped; entries still queued then are logged as lost."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._writer.join(timeout_s)
        until = time.monotonic() + timeout_s
        while not self.flush() and time.monotonic() < until:
            time.sleep(0.2)
        if self.pending:
            log.error("usage ledger: %d entries not written at shutdown", self.pending)


StreamPage = list[tuple[bytes | str, dict[bytes | str, bytes | str]]]


def read(
    client: redis.Redis, namespace: str, since_ms: int = 0, until_ms: int | None = None
) -> Iterator[UsageEntry]:
    """The entries of requests that ended in [since_ms, until_ms), oldest write first,
    each once. An entry is written after its request ended, so reading starts at the
    stream id `since_ms` (less `CLOCK_SLACK_MS`: the two times come from two clocks); it
    may be written after `until_ms` (queued through an outage), so reading goes to the
    stream's end."""
    key, start = stream_key(namespace), f"{max(0, since_ms - CLOCK_SLACK_MS)}-0"
    seen: set[str] = set()
    order: collections.deque[str] = collections.deque()
    while True:
        page = cast(StreamPage, client.xrange(key, min=start, max="+", count=READ_PAGE))
        for _, stored in page:
            entry = UsageEntry.parse(_decoded(stored))
            if entry.id in seen or entry.ended_ms < since_ms:
                continue
            seen.add(entry.id)
            order.append(entry.id)
            if len(order) > DEDUPE_WINDOW:
                seen.discard(order.popleft())
            if until_ms is None or entry.ended_ms < until_ms:
                yield entry
        if len(page) < READ_PAGE:
            return
        start = "(" + _text(page[-1][0])


def _decoded(stored: dict[bytes | str, bytes | str]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in stored.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class UsageTotals:
    """Sums over entries for one (tenant, model, adapter)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, entry: UsageEntry) -> None:
        self.requests += 1
        self.prompt_tokens += entry.prompt_tokens
        self.cached_tokens += entry.cached_tokens
        self.completion_tokens += entry.completion_tokens


def totals(entries: Iterator[UsageEntry]) -> dict[tuple[str, str, str], UsageTotals]:
    """Usage by (tenant, model, adapter), in first-seen order."""
    out: dict[tuple[str, str, str], UsageTotals] = {}
    for entry in entries:
        out.setdefault((entry.tenant, entry.model, entry.adapter), UsageTotals()).add(entry)
    return out


class LedgerCollector(Collector):
    """`pdserve_usage_ledger_{pending,written,dropped}`, read at scrape time from
    `counts` (a ledger's `counts`)."""

    def __init__(self, counts: Callable[[], LedgerCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ledger = self._counts()
        yield GaugeMetricFamily(
            "pdserve_usage_ledger_pending",
            "Usage entries queued for the ledger (grows while Redis is unreachable)",
            value=ledger.pending,
        )
        yield CounterMetricFamily(
            "pdserve_usage_ledger_written", "Usage entries stored in the ledger",
            value=ledger.written,
        )  # fmt: skip
        yield CounterMetricFamily(
            "pdserve_usage_ledger_dropped",
            "Usage entries dropped because the queue was full through a long outage",
            value=ledger.dropped,
        )
