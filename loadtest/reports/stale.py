"""Committed results that no longer describe main in ways no digest shows: which, since
which commit, and why.

Lifecycle: a result is stale by itself once a path its benchmark declares (`MEASURES`)
changes (`freshness`). This registry is for the rest: when main changes under a
committed result outside those paths (a default flipped in the CLI, a dependency of
another package, the host), an entry goes into `STALE` in the same commit as the
finding, naming the result (its file's stem: `spec` for docs/results/spec.json, `peer`
for docs/results/peer/peer.json, one of the files below the top that
`results.EXTRA_RESULTS` lists), the commit that made it stale and, in the reason, what
changed and what a re-run measured if one was made. `results` reads the registry when
it renders docs/benchmarks.md: a stale result keeps its numbers, its section says "stale
since <commit>: <reason>", its targets read "not current" instead of met or not met, and
the page's count of met targets leaves it out. A fresh run committed under docs/results/
replaces the file; its entry is deleted in the same commit.

A re-run quoted in a reason is one made on main as of the commit that registers it;
where its host differs from the committed file's, the reason says so: such a number
tells which way a result moved, not what the file's host would measure now.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class StaleResult:
    """One committed result that main has moved past."""

    result: str  # the result file's stem: "spec" for docs/results/spec.json
    # The full hash of the commit from which the result no longer holds; None only for
    # a finding of `freshness` that git cannot date.
    since: str | None
    reason: str  # what changed, and what a re-run measured; one sentence, no final stop

    def __post_init__(self) -> None:
        if not self.result or "/" in self.result or self.result.endswith(".json"):
            raise ValueError(f"result must be a file stem like 'spec', got {self.result!r}")
        if self.since is not None and not _COMMIT.fullmatch(self.since):
            raise ValueError(f"{self.result}: since must be a full commit hash, got {self.since!r}")
        if not self.reason.strip():
            raise ValueError(f"{self.result}: a stale result needs its reason")

    @property
    def line(self) -> str:
        """The sentence the page shows beside the result's section."""
        since = "" if self.since is None else f" since `{self.since[:12]}`"
        return f"Stale{since}: {self.reason}."


#: Empty while every committed result is current or stale by its digests alone.
STALE: tuple[StaleResult, ...] = ()


def by_result(entries: Iterable[StaleResult] = STALE) -> dict[str, StaleResult]:
    """The entries keyed by result; ValueError if a result is registered twice."""
    found: dict[str, StaleResult] = {}
    for entry in entries:
        if entry.result in found:
            raise ValueError(f"{entry.result} is registered as stale twice")
        found[entry.result] = entry
    return found
