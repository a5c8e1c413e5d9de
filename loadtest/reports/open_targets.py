"""Targets the committed results miss, each held open by an issue: which result, which
target, which issue.

Lifecycle: a result committed under docs/results/ with a target that reads not met gets
an entry in `OPEN` in the same commit, naming the issue that holds the target open (a
target is not met until a run meets it: it is never dropped or loosened instead).
`loadtest.reports.results` lists every open target of a current result, with what was
measured and its issue, at the top of docs/benchmarks.md, and `--check` (`make lint`)
fails on a current result's missed target that no entry names, and on an entry whose
current result meets its target or no longer states it (delete the entry in the commit
that lands the run that meets it). A stale result's targets are not current, so its
entries are neither required nor checked until a fresh run replaces it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.reports.markdown import Json, fmt, table, targets_of


@dataclass(frozen=True)
class OpenTarget:
    """One target a committed result misses, and the issue that holds it open."""

    result: str  # the result file's stem, as in `stale`: "lora" for docs/results/lora.json
    target: str  # the target's name, exactly as the result file states it
    issue: int

    def __post_init__(self) -> None:
        if not self.result or "/" in self.result or self.result.endswith(".json"):
            raise ValueError(f"result must be a file stem like 'lora', got {self.result!r}")
        if not self.target.strip():
            raise ValueError(f"{self.result}: an open target needs the target's name")
        if self.issue <= 0:
            raise ValueError(f"{self.result}: {self.target!r} needs the number of its issue")

    @property
    def key(self) -> tuple[str, str]:
        return (self.result, self.target)


#: Every target missed by a committed result, with its issue (41: elastic P/D; 43:
#: evidence and the targets it re-measured; 45: fleet integrity). Ordered as the page.
OPEN: tuple[OpenTarget, ...] = (
    OpenTarget("shifting", "shifting workload elastic / better of static and colocated", 41),
    OpenTarget("engine", "batch 32: pdserve / pdserve float32 tok/s", 43),
    OpenTarget("roofline", "bf16 prefill / bf16 GEMM roof", 43),
    OpenTarget("roofline", "bf16 decode b1 / bandwidth bound", 43),
    OpenTarget("transfer", "nixl/memcpy @8192 contig", 43),
    OpenTarget("transfer", "checked/plain nixl @8192 contig", 45),
    OpenTarget("transfer", "checked/plain nixl @8192 scatter", 45),
    OpenTarget("transfer", "nixl/memcpy @8192 scatter", 43),
    OpenTarget("router", "route p99 ms (mixed)", 43),
    OpenTarget("router", "route p99 ms (pd)", 43),
    OpenTarget("overload", "served past budget + 10%", 43),
    OpenTarget("fairness", "tenant-b attainment noisy / alone", 43),
    OpenTarget("fairness", "tenant-c attainment noisy / alone", 43),
    OpenTarget("fairness", "tenant-b attainment noisy_2gw / alone_2gw", 43),
    OpenTarget("fairness", "tenant-c attainment noisy_2gw / alone_2gw", 43),
    OpenTarget("lora", "all-linear-r16 x4 mixed / base tokens/s", 43),
)


def by_key(entries: Iterable[OpenTarget] = OPEN) -> dict[tuple[str, str], OpenTarget]:
    """The entries by (result, target); ValueError if one is listed twice."""
    keyed: dict[tuple[str, str], OpenTarget] = {}
    for entry in entries:
        if entry.key in keyed:
            raise ValueError(f"{entry.result}: {entry.target!r} is listed twice")
        keyed[entry.key] = entry
    return keyed


def _current(
    loaded: Sequence[tuple[Path, Json]], stale: Mapping[str, object]
) -> dict[str, list[Json]]:
    """The targets of each current result, by the result's stem."""
    return {path.stem: targets_of(data) for path, data in loaded if path.stem not in stale}


def problems(
    loaded: Sequence[tuple[Path, Json]],
    stale: Mapping[str, object],
    entries: Iterable[OpenTarget] = OPEN,
) -> list[str]:
    """What `--check` fails on: a current result's missed target without an entry, and an
    entry whose current result meets the target or does not state it. Results that are
    stale or not in `loaded` are not checked."""
    keyed = by_key(entries)
    found: list[str] = []
    for stem, targets in _current(loaded, stale).items():
        named = {str(t.get("name")): t for t in targets}
        for name, target in named.items():
            if not target.get("met") and (stem, name) not in keyed:
                found.append(
                    f"{stem}: target {name!r} is not met and no issue holds it open: "
                    "add it to OPEN in loadtest/reports/open_targets.py"
                )
        for result, name in keyed:
            if result != stem:
                continue
            if name not in named:
                found.append(f"{stem}: OPEN names {name!r}, which the result does not state")
            elif named[name].get("met"):
                found.append(f"{stem}: {name!r} is met now: delete its entry from OPEN")
    return found


def open_table(
    loaded: Sequence[tuple[Path, Json]],
    stale: Mapping[str, object],
    entries: Iterable[OpenTarget] = OPEN,
) -> list[str]:
    """The page's list of open targets: every missed target of a current result, with
    its measurement and its issue (nothing if none is missed)."""
    keyed = by_key(entries)
    rows = [
        _row(stem, t, keyed)
        for stem, targets in _current(loaded, stale).items()
        for t in targets
        if not t.get("met")
    ]
    if not rows:
        return []
    return [
        "## Open targets",
        "",
        "Every target a current result misses, with the issue that holds it open "
        "(`loadtest/reports/open_targets.py`; a stale result's targets are listed only "
        "once it is re-run).",
        "",
        *table(["result", "target", "measured", "wanted", "issue"], rows),
        "",
    ]


def _row(stem: str, target: Json, keyed: Mapping[tuple[str, str], OpenTarget]) -> list[str]:
    """One missed target's row; its issue reads **none** where no entry holds it."""
    name = str(target.get("name"))
    entry = keyed.get((stem, name))
    wanted = f"{target.get('comparison')} {fmt(target.get('threshold'), 'g')}"
    issue = "**none**" if entry is None else f"#{entry.issue}"
    return [stem, name, fmt(target.get("measured"), ".3f"), wanted, issue]
