"""The flow-control SLO: each class's TTFT budget, and when a refusal or a late first
token breaks the promise admission control makes.

Lifecycle: a flow benchmark builds one `FlowSlo` from its flags (`FlowSlo.of`, the
gateway's budgets unless the run overrides them) and judges every finished record with
it: `met` (completed, first token within its class's budget), `served_late` (a first
token past budget x (1 + tolerance): admission let in a request it could not serve in
time) and `refusal_timing` (when a refusal came, against when it may come).

The promise: a request the cluster cannot start within its class's budget is refused at
once, or waits in the room for at most that budget and is then refused. So a refusal is
`IMMEDIATE` (within `immediate_s` of its send), `AT_BUDGET` (within the tolerance around
its budget), `MID_WAIT` (in between: a higher class took its place, which is allowed) or
`LATE` (after budget x (1 + tolerance) + slack: the violation). The slack absorbs the
client's own scheduling on a busy host.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from engine.priority import Priority

#: The gateway's default budgets (`GatewayConfig.ttft_budget_<class>_s`), used when a
#: run does not set its own.
DEFAULT_BUDGETS_S: Mapping[Priority, float] = MappingProxyType(
    {Priority.CRITICAL: 10.0, Priority.STANDARD: 5.0, Priority.SHEDDABLE: 2.0}
)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class RefusalTiming(enum.StrEnum):
    IMMEDIATE = "immediate"
    MID_WAIT = "mid_wait"
    AT_BUDGET = "at_budget"
    LATE = "late"


@dataclass(frozen=True)
class FlowSlo:
    budgets_s: Mapping[Priority, float]
    immediate_s: float = 0.05
    tolerance: float = 0.1  # relative, around the budget
    slack_s: float = 0.2  # absolute, on top of the tolerance, for refusals only
    itl_s: float | None = None  # the p90 of a request's own token gaps (None: not judged)

    @classmethod
    def of(
        cls, overrides: Mapping[Priority, float | None], immediate_s: float,
        tolerance: float, slack_s: float, itl_s: float | None = None,
    ) -> FlowSlo:  # fmt: skip
        """The default budgets with the run's overrides (None keeps a default)."""
        budgets = {p: _or(overrides.get(p), DEFAULT_BUDGETS_S[p]) for p in Priority}
        return cls(MappingProxyType(budgets), immediate_s, tolerance, slack_s, itl_s)

    def __post_init__(self) -> None:
        if set(self.budgets_s) != set(Priority) or min(self.budgets_s.values()) <= 0:
            raise ValueError("every class needs a TTFT budget > 0")
        if self.immediate_s <= 0 or self.tolerance < 0 or self.slack_s < 0:
            raise ValueError("immediate_s must be > 0, tolerance and slack_s >= 0")
        if self.itl_s is not None and self.itl_s <= 0:
            raise ValueError(f"the ITL SLO must be > 0, got {self.itl_s}")

    def budget_s(self, priority: Priority) -> float:
        return self.budgets_s[priority]

    def met(
        self, priority: Priority, completed: bool, ttft_s: float | None,
        itl_p90_s: float | None = None,
    ) -> bool:  # fmt: skip
        """Completed, first token within its class's budget, and (with an ITL SLO) the
        p90 of its own token gaps within it (a request of one token has no gap)."""
        in_time = completed and ttft_s is not None and ttft_s <= self.budget_s(priority)
        return in_time and (self.itl_s is None or itl_p90_s is None or itl_p90_s <= self.itl_s)

    def served_late(self, priority: Priority, ttft_s: float | None) -> bool:
        return ttft_s is not None and ttft_s > self.budget_s(priority) * (1 + self.tolerance)

    def refusal_timing(self, priority: Priority, latency_s: float) -> RefusalTiming:
        budget = self.budget_s(priority)
        if latency_s <= self.immediate_s:
            return RefusalTiming.IMMEDIATE
        if latency_s > budget * (1 + self.tolerance) + self.slack_s:
            return RefusalTiming.LATE
        if latency_s >= budget * (1 - self.tolerance):
            return RefusalTiming.AT_BUDGET
        return RefusalTiming.MID_WAIT
