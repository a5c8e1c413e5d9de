"""Where a benchmark result came from: the commit, the time and the host it was taken on.

Lifecycle: a benchmark calls `collect_provenance()` once, when its run starts (so a
commit made during a long run cannot relabel it), and hands the `Provenance` to
`result_file.write_result`, which stores it under the result's `provenance` key.
`loadtest.reports.results` reads it back to say, next to every number the docs quote,
when and where it was measured.

Git is only read: `rev-parse HEAD`, and `status` with optional locks off, so a run never
rewrites the index of the checkout it measures. `dirty` means tracked files differ from
the commit (untracked files do not count, as in `git describe --dirty`, nor do
docs/results/ and docs/benchmarks.md: result files waiting to be committed must not mark
the next run dirty). Outside a git checkout (an
installed wheel) the commit is None.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

#: The checkout the loadtest package was imported from: the code that is measured.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
CPUINFO = Path("/proc/cpuinfo")
GIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Host:
    """The machine: who ran it and how much CPU it had."""

    hostname: str
    cpu_model: str
    cpu_count: int  # logical CPUs of the machine
    usable_cpus: int  # of those, the ones this process may run on (affinity)
    python: str
    platform: str


@dataclass(frozen=True)
class Provenance:
    commit: str | None  # `git rev-parse HEAD`; None outside a git checkout
    dirty: bool  # tracked files differ from the commit
    taken_at: str  # UTC, ISO 8601, when the run started
    command: str  # the command line that produced the result
    host: Host


def _git(*args: str) -> str | None:
    """stdout of a read-only git command in SOURCE_ROOT, or None if git cannot answer."""
    # GIT_OPTIONAL_LOCKS=0: `git status` must not refresh (and so rewrite) the index.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(
            ["git", *args], cwd=SOURCE_ROOT, env=env, capture_output=True, text=True,
            timeout=GIT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host_info() -> Host:
    return Host(
        hostname=socket.gethostname(),
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count() or 0,
        usable_cpus=len(os.sched_getaffinity(0)),
        python=platform.python_version(),
        platform=platform.platform(),
    )


# Result files and the page rendered from them do not change what a run measures: a
# refreshed result waiting to be committed must not mark the next run dirty.
_MEASURED = (":(top)", ":(top,exclude)docs/results", ":(top,exclude)docs/benchmarks.md")


def collect_provenance(command: Sequence[str] | None = None) -> Provenance:
    """Commit, dirty flag, UTC start time, command line (default: this process's argv)
    and host, as of now."""
    head = _git("rev-parse", "HEAD")
    status = (
        _git("status", "--porcelain", "--untracked-files=no", "--", *_MEASURED) if head else None
    )
    return Provenance(
        commit=head.strip() if head else None,
        dirty=bool(status and status.strip()),
        taken_at=datetime.now(UTC).isoformat(timespec="seconds"),
        command=shlex.join(sys.argv if command is None else command),
        host=host_info(),
    )


def describe(p: Provenance) -> str:
    """One line for a table or the docs: commit, dirty flag, time and host."""
    commit = "no git checkout" if p.commit is None else f"commit {p.commit[:12]}"
    dirty = " with uncommitted changes" if p.dirty else ""
    h = p.host
    return (
        f"{commit}{dirty}; taken {p.taken_at} on {h.hostname} ({h.cpu_model}; "
        f"{h.usable_cpus} of {h.cpu_count} CPUs usable)"
    )
