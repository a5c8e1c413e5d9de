"""What a benchmarked cluster costs: per hour, and per million output tokens at the SLO.

Lifecycle: `pdserve-bench --node-cost-per-hour` gives a node's hourly cost, one number
for every worker or one per role (`prefill=2.5,decode=1.8,mixed=2.0`). Before the first
point the bench counts the cluster's workers by role from the gateway's ClusterStatus
(`count_workers`), prices them once (`ClusterCost`), and each point's report divides
that by the output tokens per hour of the requests that met the SLO. The gateway and
Redis are not counted (the chart's live rule counts the gateway's pods too): give their
share in the nodes' numbers if it matters. Workers are priced by their role when the
run starts; with elastic roles a worker that changes role keeps its first price.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from services.gateway.client import GatewayClient

ROLES = ("prefill", "decode", "mixed")


@dataclass(frozen=True)
class NodeCosts:
    """A node's cost per hour by role (the same for every role from a plain number)."""

    by_role: dict[str, float]

    @classmethod
    def parse(cls, text: str) -> NodeCosts:
        """`"2.5"` or `"prefill=2.5,decode=1.8"`; ValueError names the flag."""
        text = text.strip()
        try:
            if "=" not in text:
                return cls({role: _cost(float(text)) for role in ROLES})
            pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
            costs = {role.strip(): _cost(float(value)) for role, value in pairs}
        except ValueError as exc:
            raise ValueError(
                f"node_cost_per_hour: {text!r}: give a cost per hour >= 0, or role=cost pairs "
                f"({exc})"
            ) from None
        unknown = set(costs) - set(ROLES)
        if unknown:
            raise ValueError(f"node_cost_per_hour: roles are {', '.join(ROLES)}; got {unknown}")
        return cls(costs)

    def per_hour(self, workers: dict[str, int]) -> float:
        """The cost of `workers` (role -> count); ValueError for a role with no price."""
        missing = {role for role, n in workers.items() if n and role not in self.by_role}
        if missing:
            raise ValueError(f"node_cost_per_hour: no cost given for the {missing} workers")
        return sum(self.by_role[role] * n for role, n in workers.items() if n)


def _cost(value: float) -> float:
    if not value >= 0:
        raise ValueError(f"{value} is negative")
    return value


async def count_workers(address: str) -> dict[str, int]:
    """The gateway's workers by role (ClusterStatus; an admin call when keys are on);
    ValueError naming any worker the gateway could not reach (its role is unknown)."""
    async with GatewayClient(address) as client:
        status = await client.cluster_status()
    lost = [w.worker_id for w in status.workers if w.role not in ROLES]
    if lost:
        raise ValueError(f"node_cost_per_hour: cannot price workers the gateway cannot reach: "
                         f"{', '.join(lost)}")  # fmt: skip
    return dict(collections.Counter(w.role for w in status.workers))


@dataclass(frozen=True)
class ClusterCost:
    """The priced cluster, as the results file records it."""

    workers: dict[str, int]
    per_hour: float

    def per_million_tokens(self, goodput_tokens_per_s: float) -> float | None:
        """Cost per million output tokens of requests within the SLO (None: no such token)."""
        if goodput_tokens_per_s <= 0:
            return None
        return self.per_hour / (goodput_tokens_per_s * 3600) * 1e6
