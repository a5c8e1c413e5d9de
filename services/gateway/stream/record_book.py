"""What the gateway's live requests hold, counted per resource, and its Prometheus gauge.

Lifecycle: the gateway keeps one `RecordBook`. Each request record
(`services.gateway.stream.request_record`) reports what it holds after every change
(`update`) and leaves the book when its cleanup is over (`forget`), so
`count(resource)` is always the number of live records holding that resource: the
stream cap reads the stream slots here, and `HeldCollector` exposes every count as
`pdserve_gateway_held{resource}`, which a leak check expects to be 0 once requests end.
Everything runs on the event loop; the metrics endpoint's thread only copies the counts,
whose keys never change.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

GAUGE = "pdserve_gateway_held"


class Resource(enum.StrEnum):
    """What a request can hold; the value is the gauge's `resource` label."""

    ADMISSION = "admission"  # admitted, counted against capacity until its KV reaches decode
    STREAM_SLOT = "stream_slot"  # one of --max-streams
    LOAD_LEASE = "load_lease"  # the router's load leases on the chosen workers
    QUOTA_CHARGE = "quota_charge"  # prompt + max_tokens charged to the tenant's minute
    PREFILL_LEASE = "prefill_lease"  # KV a prefill worker keeps for a decode worker to pull
    DECODE_STREAM = "decode_stream"  # the open Decode call


R = TypeVar("R", bound=Hashable)


class RecordBook(Generic[R]):
    def __init__(self) -> None:
        self._live: dict[R, frozenset[Resource]] = {}
        self._counts: dict[Resource, int] = dict.fromkeys(Resource, 0)

    def update(self, record: R, held: frozenset[Resource]) -> None:
        """`record` is live and now holds exactly `held`."""
        before = self._live.get(record, frozenset())
        for resource in held - before:
            self._counts[resource] += 1
        for resource in before - held:
            self._counts[resource] -= 1
        self._live[record] = held

    def forget(self, record: R) -> None:
        """`record` is closed: it holds nothing and is no longer live."""
        if record in self._live:
            self.update(record, frozenset())
            del self._live[record]

    def count(self, resource: Resource) -> int:
        return self._counts[resource]

    def counts(self) -> dict[Resource, int]:
        return dict(self._counts)

    def live(self) -> list[R]:
        return list(self._live)

    def __len__(self) -> int:
        return len(self._live)


class HeldCollector(Collector):
    """`pdserve_gateway_held{resource}`, read from the book at scrape time."""

    def __init__(self, book: RecordBook[R]) -> None:
        self._counts = book.counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            GAUGE,
            "Live gateway requests holding each resource (all 0 when no request is open)",
            labels=["resource"],
        )
        for resource, n in self._counts().items():
            family.add_metric([resource.value], n)
        yield family
