"""Docs that quote a result which is not current must say so.

Lifecycle: `python -m loadtest.reports.results --check true` (in `make lint`) calls
`unmarked_quotes` with the results that are not current (`freshness`) and the pages
that may quote them: README.md and docs/*.md, but not docs/benchmarks.md (generated,
it marks them itself) nor docs/history.md (a record of past runs, dated). A quote is a
link to a result's section of benchmarks.md (`benchmarks.md#<anchor>`) or a mention of
its file (`results/<name>.json`) or one of its targets' ratios as the docs write them
("1.91x": `ratio_quotes`) when the paragraph links no current result (a link names
where its numbers come from). A paragraph (lines
between blank lines) that quotes a stale result must say "stale" or "not current" in
it; otherwise the check names the file, line and result, and lint fails until the
result is re-run or the text says what it quotes is old.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Pages that keep their own dates and do not need the check.
EXEMPT = frozenset({"benchmarks.md", "history.md"})
_MARKED = re.compile(r"\bstale\b|\bnot current\b", re.IGNORECASE)


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to
    hyphens."""
    kept = re.sub(r"[^\w\- ]", "", title.lower())
    return kept.replace(" ", "-")


@dataclass(frozen=True)
class StaleQuote:
    """A paragraph that quotes a stale result without saying it is stale."""

    page: Path
    line: int  # 1-based, the first line of the paragraph
    result: str  # the result's file stem

    def __str__(self) -> str:
        return (
            f"{self.page}:{self.line}: quotes result {self.result!r}, which is not current; "
            "re-run it, or say in the paragraph that the numbers are stale"
        )


@dataclass(frozen=True)
class QuotedResult:
    """How a page can point at one result: its file name and its section's anchor."""

    stem: str
    file: str  # the path below the results directory: "spec.json", "peer/peer.json"
    title: str  # its section's heading on benchmarks.md
    ratios: frozenset[str] = frozenset()  # its targets' ratios as quoted: "1.91x"
    current: bool = False

    def linked_in(self, text: str) -> bool:
        # Not preceded by a word character or hyphen: "bench-results/soak.json", where a
        # benchmark writes a fresh run, is not the committed file.
        committed = re.search(rf"(?<![\w-])results/{re.escape(self.file)}", text)
        return committed is not None or f"benchmarks.md#{anchor(self.title)}" in text

    def ratios_in(self, text: str) -> set[str]:
        return {r for r in self.ratios if re.search(rf"(?<![\d.]){re.escape(r)}", text)}


def ratio_quotes(targets: Iterable[Mapping[str, object]]) -> frozenset[str]:
    """The ratios of `targets` as prose quotes them, two decimals and an x ("0.72x");
    1.00x is left out, being what any comparison of equals reads."""
    quotes = set()
    for target in targets:
        measured = target.get("measured")
        if isinstance(measured, int | float) and f"{measured:.2f}" != "1.00":
            quotes.add(f"{measured:.2f}x")
    return frozenset(quotes)


def pages(readme: Path, docs: Path) -> list[Path]:
    """README and the docs pages the check reads."""
    return [readme, *sorted(p for p in docs.glob("*.md") if p.name not in EXEMPT)]


def _paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of each run of non-blank lines."""
    start, block = 0, []
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.strip():
            start = start or number
            block.append(line)
        elif block:
            yield start, "\n".join(block)
            start, block = 0, []


def _quoted(paragraph: str, results: Sequence[QuotedResult]) -> list[str]:
    """The stale results `paragraph` quotes: those it links, and, when it links no
    current result (which would name the source of its numbers), those whose ratios it
    has."""
    linked = [r for r in results if r.linked_in(paragraph)]
    sourced = any(r.current for r in linked)
    return [
        r.stem
        for r in results
        if not r.current and (r in linked or (not sourced and r.ratios_in(paragraph)))
    ]


def unmarked_quotes(results: Sequence[QuotedResult], paths: Iterable[Path]) -> list[StaleQuote]:
    """Every paragraph of `paths` that quotes a stale one of `results` without saying so."""
    found = []
    for page in paths:
        for line, paragraph in _paragraphs(page.read_text(encoding="utf-8")):
            if not _MARKED.search(paragraph):
                found += [StaleQuote(page, line, stem) for stem in _quoted(paragraph, results)]
    return found
