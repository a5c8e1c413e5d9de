"""The one command-line mapping of the benchmarks: flags -> configs -> run -> JSON + table.

Lifecycle of `python -m <spec.module> [flags]` (`python -m loadtest.engine.bench`, say),
for every benchmark that declares a `BenchSpec`:

1. `parse_args` builds one parser: the `RunSettings` fields the benchmark takes (`--out`,
   `--seed`, `--model-cache-dir`, ...), then one flag per field of the benchmark's own
   frozen config dataclass (`services.common.config`: `--foo-bar` and `PDSERVE_FOO_BAR`),
   then its `Alias` shorthands (`--smoke` = `--preset smoke`). A config that rejects its
   values is a usage error (exit 2), not a traceback.
2. `run_main` collects the provenance (commit, time, host) before anything runs, then
   calls `spec.run(settings, config)`, writes the report with `result_file.write_result`
   and prints `spec.table(report)` and the provenance line. SIGTERM unwinds like Ctrl-C
   while it runs, so a benchmark's `finally` blocks stop the processes it started (a
   Redis, an exporter, a cluster) whichever way it is stopped.

`pdserve-bench` (`loadtest.harness.cli`) and the headline write a directory rather than
one file; they use `add_settings_args` and `settings_from_args` from here with their own
runners.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Generic, TypeVar

from loadtest.harness.settings import RunSettings
from loadtest.reports.provenance import collect_provenance, describe
from loadtest.reports.result_file import write_result
from services.common.config import add_config_args, config_from_args

C = TypeVar("C")
R = TypeVar("R")
RESULTS_DIR = Path("bench-results")


@dataclass(frozen=True)
class Alias:
    """A shorthand flag that sets one config field to a constant: `--smoke` is
    `--preset smoke`. Aliases of the same field exclude each other."""

    flag: str
    field: str
    value: object
    help: str


@dataclass(frozen=True)
class BenchSpec(Generic[C, R]):
    """A benchmark as the command line sees it. `run` must not print the table; `table`
    renders the report for a terminal."""

    name: str  # the default out is bench-results/<name>.json
    # The module that runs it, `python -m <module>` (its `__name__` is "__main__" then,
    # so it is spelled out).
    module: str
    description: str
    config: type[C]
    run: Callable[[RunSettings, C], R]
    table: Callable[[R], str]
    settings: tuple[str, ...] = ("out", "seed")  # the RunSettings fields it takes as flags
    aliases: tuple[Alias, ...] = ()
    measures: tuple[str, ...] = ()  # the source paths its numbers describe (`MEASURES`)
    # A gate's pass/fail (`loadtest.perf_gate`): False makes the command exit 1. None:
    # the command exits 0 whatever the targets say (the report says).
    verdict: Callable[[R], bool] | None = None

    @property
    def prog(self) -> str:
        return f"python -m {self.module}"

    @property
    def default_out(self) -> Path:
        return RESULTS_DIR / f"{self.name}.json"


class Progress:
    """Timestamped progress lines on stderr, prefixed with the benchmark's name (stdout
    carries only the table, which tests and scripts read)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, message: str) -> None:
        print(f"[{self.name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def add_settings_args(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Flags for the named `RunSettings` fields only."""
    known = [f.name for f in dataclasses.fields(RunSettings)]
    unknown = set(names) - set(known)
    if unknown:
        raise ValueError(f"RunSettings has no field {sorted(unknown)}")
    add_config_args(parser, RunSettings, exclude=tuple(n for n in known if n not in names))


def settings_from_args(args: argparse.Namespace, default_out: Path | None = None) -> RunSettings:
    settings = config_from_args(RunSettings, args)
    return replace(settings, out=settings.out or default_out)


def build_parser(spec: BenchSpec[C, R]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=spec.prog, description=spec.description)
    add_settings_args(parser, spec.settings)
    if "out" in spec.settings and parser.get_default("out") is None:
        parser.set_defaults(out=spec.default_out)  # PDSERVE_OUT, when set, stays the default
    add_config_args(parser, spec.config)
    fields = {f.name for f in dataclasses.fields(spec.config)}  # type: ignore[arg-type]
    by_field: dict[str, list[Alias]] = {}
    for alias in spec.aliases:
        if alias.field not in fields:
            raise ValueError(f"alias {alias.flag} sets unknown field {alias.field!r}")
        by_field.setdefault(alias.field, []).append(alias)
    for aliases in by_field.values():
        group = parser.add_mutually_exclusive_group()
        for alias in aliases:
            # SUPPRESS: an absent alias leaves the field's own flag (or env var) in charge.
            group.add_argument(alias.flag, dest=alias.field, action="store_const",
                               const=alias.value, default=argparse.SUPPRESS,
                               help=alias.help)  # fmt: skip
    return parser


def parse_args(spec: BenchSpec[C, R], argv: Sequence[str] | None = None) -> tuple[RunSettings, C]:
    """The run's settings (out filled in) and the benchmark's config, both validated."""
    parser = build_parser(spec)
    args = parser.parse_args(argv)
    try:
        return settings_from_args(args, spec.default_out), config_from_args(spec.config, args)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit (main thread only: signals are delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_main(spec: BenchSpec[C, R], argv: Sequence[str] | None = None) -> int:
    """Parse, run, write the JSON, print the table. Exit 0 whether targets are met or not
    (the report says, and a benchmark that cannot measure raises), unless the spec has a
    `verdict` and the report fails it: then 1."""
    args = list(sys.argv[1:] if argv is None else argv)
    settings, cfg = parse_args(spec, args)
    provenance = collect_provenance([*spec.prog.split(), *args], spec.measures)
    with sigterm_unwinds():
        report = spec.run(settings, cfg)
    write_result(settings.out_path, report, provenance)
    print(spec.table(report))
    print(describe(provenance))
    print(f"wrote {settings.out_path}")
    return 0 if spec.verdict is None or spec.verdict(report) else 1
