"""Whether a committed result still describes the code: its measured sources against
the tree the page is rendered for.

Lifecycle: `loadtest.reports.results` loads the result files, then asks `findings` which
are not current. A result is not current when the digests its provenance recorded for
the benchmark's `MEASURES` (`loadtest.reports.sources`) differ from those of the same
paths in the rendered tree (HEAD when git can read it, else the working tree), or when
it recorded none (nothing could tell a change apart). The finding names the paths that
changed and, when git can date it, the first commit after the result's that touched
them, so the page reads "Stale since <commit>". The hand-kept registry
(`loadtest.reports.stale`) adds the changes no digest can see: a default flipped in a
file the benchmark does not declare, say. Nothing here reads the clock, so the page
depends only on the files and the tree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from loadtest.reports.markdown import Json
from loadtest.reports.sources import SourceRecord, Tree, changed, first_change
from loadtest.reports.stale import StaleResult

#: A finding's text before its reason, dated or not (`undated`).
_DATED = re.compile(r"Stale since `[0-9a-f]{12}`: (its measured sources changed)")


def undated(page: str) -> str:
    """`page` with the commits that date its source findings taken out: what a shallow
    clone, which cannot date them, can still compare."""
    return _DATED.sub(r"Stale: \1", page)


NO_SOURCES = (
    "the result records no measured sources, so no change to its code can be seen: re-run "
    "it with a benchmark that declares `MEASURES`"
)


def rendered_tree() -> Tree:
    """The tree the page describes: HEAD's when git can read it, else the working tree."""
    return Tree.at("HEAD") or Tree()


def source_finding(stem: str, data: Json, tree: Tree) -> StaleResult | None:
    """The finding for one result, or None while its measured sources are unchanged."""
    provenance = data.get("provenance", {})
    recorded = SourceRecord.from_json(provenance.get("sources"))
    if recorded is None:
        return StaleResult(stem, None, NO_SOURCES)
    moved = changed(recorded, tree)
    if not moved:
        return None
    commit = provenance.get("commit")
    since = None
    if commit and tree.commit:
        since = first_change(commit, moved, tree.commit, tree.root)
    paths = ", ".join(f"`{path}`" for path in moved)
    return StaleResult(stem, since, f"its measured sources changed since the run: {paths}")


def findings(
    loaded: Sequence[tuple[Path, Json]],
    tree: Tree,
    registry: Mapping[str, StaleResult],
) -> dict[str, list[StaleResult]]:
    """Result stem -> why it is not current (the registry's entry first, then the
    sources' finding); results that are current are absent."""
    found: dict[str, list[StaleResult]] = {}
    for path, data in loaded:
        entries = [registry[path.stem]] if path.stem in registry else []
        finding = source_finding(path.stem, data, tree)
        if finding is not None:
            entries.append(finding)
        if entries:
            found[path.stem] = entries
    return found
