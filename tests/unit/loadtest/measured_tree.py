"""A source tree of one measured file, for tests of the page's current and stale results:
a result whose provenance carries `SOURCES` is current against `measured_tree(root)`
until the test edits the file (`edit`)."""

from __future__ import annotations

from pathlib import Path

from loadtest.reports.sources import SourceRecord, Tree, digest_files

MEASURED = "bench.py"
TEXT = b"measured\n"
SOURCES = SourceRecord({MEASURED: digest_files([(MEASURED, TEXT)])})


def measured_tree(root: Path) -> Tree:
    """A working tree at `root` holding the measured file as the result recorded it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / MEASURED).write_bytes(TEXT)
    return Tree(root)


def edit(tree: Tree) -> None:
    (tree.root / MEASURED).write_bytes(TEXT + b"# changed\n")
