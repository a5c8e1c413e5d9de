"""A benchmark's target: a measured number held to a threshold, met or not.

Lifecycle: a benchmark evaluates its targets once its measurements are in
(`TargetResult.check`), stores them in its report and prints them with `target_rows`.
A missed target is reported, never raised: the run still writes everything it measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COMPARISONS = (">=", "<=")


@dataclass(frozen=True)
class TargetResult:
    name: str
    measured: float
    threshold: float
    comparison: str  # ">=" or "<="
    met: bool
    context: str = ""  # the same run's baseline, to tell a slow component from a noisy host

    @classmethod
    def check(
        cls, name: str, measured: float, comparison: str, threshold: float, context: str = ""
    ) -> TargetResult:
        if comparison not in COMPARISONS:
            raise ValueError(f"comparison must be one of {COMPARISONS}, got {comparison!r}")
        met = measured >= threshold if comparison == ">=" else measured <= threshold
        return cls(name, measured, threshold, comparison, met, context)


def target_rows(targets: Sequence[TargetResult]) -> list[str]:
    """One indented line per target: name, measured, comparison, threshold, verdict."""
    width = max((len(t.name) for t in targets), default=0)
    return [
        f"  {t.name:<{width}} {t.measured:8.3f} {t.comparison} {t.threshold:<5g} "
        f"{'met' if t.met else 'UNMET':<5} {t.context}".rstrip()
        for t in targets
    ]
