"""The command line every small benchmark shares: its config's fields as flags, `--out`,
then run, write the result with its provenance, print the table.

Lifecycle: a benchmark module's `main(argv)` returns `bench_main(BenchCli(...), argv)`;
the provenance is taken before the run starts, so it names the tree that was measured.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import write_result
from services.common.config import add_config_args, config_from_args


@dataclass(frozen=True)
class BenchCli:
    """One benchmark's command line: what it is, its config, how it runs and prints."""

    doc: str  # the module docstring; its first line is the description
    config: type  # a dataclass whose scalar fields become flags
    default_out: Path
    run: Callable[[Any], object]  # config -> report (a dataclass)
    table: Callable[[Any], str]  # report -> the printed table
    exclude: tuple[str, ...] = ()  # fields that are not flags (tuples, say)
    measures: tuple[str, ...] = ()  # the source paths its numbers describe (`MEASURES`)


def bench_main(cli: BenchCli, argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=cli.doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=cli.default_out)
    add_config_args(parser, cli.config, exclude=cli.exclude)
    args = parser.parse_args(argv)
    provenance = collect_provenance(sys.argv, cli.measures)
    report = cli.run(config_from_args(cli.config, args))
    write_result(args.out, report, provenance)
    print(cli.table(report))
    return 0
