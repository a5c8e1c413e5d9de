"""Admission's Prometheus metrics: who got in, who waited, who was refused and why, and
how fairly each class's contested capacity was shared.

Lifecycle: made once per gateway on the process's registry (`AdmissionMetrics.on`), or
`disabled()` in tests; the admission controller reports each decision as it makes it and
sets the gauges on every tick.

- `pdserve_gateway_admitted_total{class, waited}`: admitted, at once ("no") or after a
  wait in the waiting room ("yes")
- `pdserve_gateway_refused_total{class, reason}`: refused before any worker did work
  (`RefusalReason`: quota, stream_cap, room_full, displaced, budget)
- `pdserve_gateway_waiting_room_seconds{class, outcome}`: time in the waiting room of
  requests that left it admitted or refused
- `pdserve_gateway_waiting_room{class}`: requests waiting now
- `pdserve_gateway_tenant_share{class, tenant}` and `..._tenant_fair_share{...}`: each
  tenant's part of its class's attained KV-block-seconds (cluster-wide, decayed) and the
  part its weight entitles it to among the tenants in the ledger
- `pdserve_gateway_fairness_index{class}`: Jain's index of the backlogged tenants'
  weight-normalised service (1.0 is perfectly fair)
- `pdserve_gateway_decode_step_predicted_seconds`: the decode step a new stream would
  join (what the ITL check compares with `itl_budget_s`)
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.priority import Priority
from services.common.status import RefusalReason
from services.gateway.flow.fair_share import FairView
from services.gateway.flow.waiting_room import WaitingRoom

WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.on = registry is not None
        if registry is None:
            return
        self._admitted = Counter(
            "pdserve_gateway_admitted_total", "Requests admitted, by class and whether they waited",
            ["class", "waited"], registry=registry,
        )  # fmt: skip
        self._refused = Counter(
            "pdserve_gateway_refused_total", "Requests refused at admission, by class and reason",
            ["class", "reason"], registry=registry,
        )  # fmt: skip
        self._wait = Histogram(
            "pdserve_gateway_waiting_room_seconds", "Time spent in the waiting room",
            ["class", "outcome"], buckets=WAIT_BUCKETS, registry=registry,
        )  # fmt: skip
        self._room = Gauge(
            "pdserve_gateway_waiting_room", "Requests waiting for capacity", ["class"],
            registry=registry,
        )  # fmt: skip
        self._share = Gauge(
            "pdserve_gateway_tenant_share", "Tenant's part of its class's attained service",
            ["class", "tenant"], registry=registry,
        )  # fmt: skip
        self._fair = Gauge(
            "pdserve_gateway_tenant_fair_share", "Tenant's weighted fair part of its class",
            ["class", "tenant"], registry=registry,
        )  # fmt: skip
        self._index = Gauge(
            "pdserve_gateway_fairness_index", "Jain's index of backlogged tenants' service",
            ["class"], registry=registry,
        )  # fmt: skip
        self._step = Gauge(
            "pdserve_gateway_decode_step_predicted_seconds",
            "The decode step (inter-token latency) a new stream would join, predicted from "
            "the decode workers' measured step times by batch size (0: none measured)",
            registry=registry,
        )

    @classmethod
    def disabled(cls) -> AdmissionMetrics:
        return cls(None)

    def admitted(self, priority: Priority, waited_s: float) -> None:
        if self.on:
            self._admitted.labels(priority.label, "yes" if waited_s > 0 else "no").inc()
            if waited_s > 0:
                self._wait.labels(priority.label, "admitted").observe(waited_s)

    def refused(self, priority: Priority, reason: RefusalReason, waited_s: float = 0.0) -> None:
        if self.on:
            self._refused.labels(priority.label, reason.value).inc()
            if reason in (RefusalReason.BUDGET, RefusalReason.DISPLACED):
                self._wait.labels(priority.label, "refused").observe(waited_s)

    def set_decode_step(self, step_s: float) -> None:
        if self.on:
            self._step.set(step_s)

    def set_waiting(self, room: WaitingRoom) -> None:
        if self.on:
            for p in Priority:
                self._room.labels(p.label).set(room.count(p))

    def set_fairness(self, view: FairView, weights: Mapping[str, float]) -> None:
        if not self.on:
            return
        for p in Priority:
            tenants = view.classes.get(p, {})
            # The ledger keeps service divided by weight; the share is of the real service.
            served = {t: s.attained * weights.get(t, 1.0) for t, s in tenants.items()}
            total_served = sum(served.values())
            total_weight = sum(weights.get(t, 1.0) for t in tenants)
            for tenant, amount in served.items():
                share = amount / total_served if total_served > 0 else 0.0
                self._share.labels(p.label, tenant).set(share)
                self._fair.labels(p.label, tenant).set(weights.get(tenant, 1.0) / total_weight)
            self._index.labels(p.label).set(view.fairness_index(p))
