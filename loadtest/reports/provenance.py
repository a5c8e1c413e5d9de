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
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from loadtest.reports.sources import SOURCE_ROOT, SourceRecord, Tree, git_output, record

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
#: The instruction-set flags the engine's kernels (oneDNN's, numba's) choose by.
FLAGS_OF_INTEREST = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


@dataclass(frozen=True)
class Host:
    """The machine: who ran it and how much CPU it had."""

    hostname: str
    cpu_model: str
    cpu_count: int  # logical CPUs of the machine
    usable_cpus: int  # of those, the ones this process may run on (affinity)
    python: str
    platform: str
    # The flags of /proc/cpuinfo that decide which kernels run (`FLAGS_OF_INTEREST`):
    # two hosts with one model string can differ in them (half-width AVX-512 units do
    # not show there, so the kernel string and the roofs still matter).
    cpu_flags: tuple[str, ...] = ()
    memory_bytes: int = 0  # MemTotal of /proc/meminfo; 0 if unknown
    kernel: str = ""  # `platform.release()`


@dataclass(frozen=True)
class Provenance:
    commit: str | None  # `git rev-parse HEAD`; None outside a git checkout
    dirty: bool  # tracked files differ from the commit
    taken_at: str  # UTC, ISO 8601, when the run started
    command: str  # the command line that produced the result
    host: Host
    # The digests of the paths the benchmark measures (its `MEASURES`), from the tree
    # the run started on; `loadtest.reports.results` calls the result stale once they
    # change. None: the benchmark declared none.
    sources: SourceRecord | None = None


def _git(*args: str) -> str | None:
    """stdout of a read-only git command in SOURCE_ROOT, or None if git cannot answer."""
    out = git_output(SOURCE_ROOT, *args)
    return None if out is None else out.decode()


def _cpuinfo_field(cpuinfo: Path, keys: tuple[str, ...]) -> str | None:
    """The first non-empty value of /proc/cpuinfo under one of `keys`, or None."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys and value.strip():
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what `platform` knows."""
    found = _cpuinfo_field(cpuinfo, ("model name", "Model", "Hardware"))
    return found or platform.processor() or platform.machine() or "unknown"


def cpu_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """Those of `FLAGS_OF_INTEREST` the first CPU of /proc/cpuinfo lists, in that order."""
    present = set((_cpuinfo_field(cpuinfo, ("flags",)) or "").split())
    return tuple(f for f in FLAGS_OF_INTEREST if f in present)


def memory_bytes(meminfo: Path = MEMINFO) -> int:
    """The machine's memory (MemTotal), or 0 when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_info() -> Host:
    return Host(
        hostname=socket.gethostname(),
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count() or 0,
        usable_cpus=len(os.sched_getaffinity(0)),
        python=platform.python_version(),
        platform=platform.platform(),
        cpu_flags=cpu_flags(),
        memory_bytes=memory_bytes(),
        kernel=platform.release(),
    )


# Result files and the page rendered from them do not change what a run measures: a
# refreshed result waiting to be committed must not mark the next run dirty.
_MEASURED = (":(top)", ":(top,exclude)docs/results", ":(top,exclude)docs/benchmarks.md")


def collect_provenance(
    command: Sequence[str] | None = None, measures: Sequence[str] = ()
) -> Provenance:
    """Commit, dirty flag, UTC start time, command line (default: this process's argv),
    host and the digests of the paths the benchmark `measures`, as of now."""
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
        sources=record(measures, Tree(SOURCE_ROOT)) if measures else None,
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
