"""The source paths a benchmark measures, and their content digests.

Lifecycle: each benchmark module declares `MEASURES`, the repository paths (files or
directories) whose code its numbers describe: the kernels or services it drives and its
own workload files. `collect_provenance(measures=MEASURES)` digests them from the
working tree when the run starts (`record`, origin RUN) and the result file keeps the
digests in its provenance. `loadtest.reports.results` digests the same paths again in
the commit it renders for (`Tree.at("HEAD")`) and calls the result stale when any
differs (`changed`). A result committed before digests were recorded got them from its
own commit's tree (origin COMMIT: exact for a run on a clean tree).

Digests are per declared path: a directory's digest covers the relative names and bytes
of every file below it, so a file added, removed, renamed or edited changes it. Caches
(`__pycache__`, `*.pyc`) and hidden files do not count. Git is read only.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

#: The checkout the loadtest package was imported from: the code that is measured.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
GIT_TIMEOUT_S = 30.0
#: What a benchmark of a running cluster measures besides its own files: every package
#: a request passes through.
SERVING_STACK = ("engine", "kvtransfer", "services")


class SourceOrigin(StrEnum):
    """Where a result's digests were taken."""

    RUN = "run"  # from the working tree the run measured (uncommitted edits included)
    COMMIT = "commit"  # afterwards, from the tree of the result's commit


@dataclass(frozen=True)
class SourceRecord:
    """A result's measured paths and their digests."""

    digests: Mapping[str, str]  # declared path -> sha256 hex of its files
    origin: SourceOrigin = SourceOrigin.RUN

    def to_json(self) -> dict[str, object]:
        return {"digests": dict(self.digests), "origin": self.origin.value}

    @staticmethod
    def from_json(data: object) -> SourceRecord | None:
        """The record in a result's provenance, or None when it has none."""
        if not isinstance(data, dict) or not isinstance(data.get("digests"), dict):
            return None
        digests = {str(k): str(v) for k, v in data["digests"].items()}
        return SourceRecord(digests, SourceOrigin(data.get("origin", SourceOrigin.RUN.value)))


def _ignored(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__" or name.endswith(".pyc")


def check_paths(paths: Sequence[str]) -> tuple[str, ...]:
    """`paths` as declared, checked: relative, inside the repository, no duplicates."""
    seen: list[str] = []
    for raw in paths:
        path = raw.rstrip("/")
        parts = Path(path).parts
        if not path or Path(path).is_absolute() or ".." in parts:
            raise ValueError(f"a measured path must be relative to the repository: {raw!r}")
        if path in seen:
            raise ValueError(f"measured path {path!r} is declared twice")
        seen.append(path)
    return tuple(seen)


def digest_files(files: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over (name, length, bytes) of each file, in name order."""
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(name.encode())
        h.update(b"\0")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Tree:
    """The files under the repository root: the working tree, or a commit's tree read
    through git (`at`)."""

    root: Path = SOURCE_ROOT
    commit: str | None = None  # None: the working tree
    _cache: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict, compare=False)

    @staticmethod
    def at(commit: str, root: Path = SOURCE_ROOT) -> Tree | None:
        """The tree of `commit`, or None when git cannot read it (no checkout, no such
        commit in a shallow clone)."""
        full = git_output(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
        return Tree(root, full.decode().strip()) if full else None

    def digests(self, paths: Sequence[str]) -> dict[str, str]:
        """Declared path -> digest of its files here (a path with no files digests the
        empty set, so a deleted file reads as changed)."""
        return {path: digest_files(self._files(path)) for path in check_paths(paths)}

    def _files(self, path: str) -> list[tuple[str, bytes]]:
        if path not in self._cache:
            found = self._from_git(path) if self.commit else list(self._from_disk(path))
            self._cache[path] = found
        return self._cache[path]

    def _from_disk(self, path: str) -> Iterator[tuple[str, bytes]]:
        top = self.root / path
        if top.is_file():
            yield path, top.read_bytes()
            return
        for folder, dirs, names in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not _ignored(d))
            for name in names:
                if not _ignored(name):
                    full = Path(folder) / name
                    yield full.relative_to(self.root).as_posix(), full.read_bytes()

    def _from_git(self, path: str) -> list[tuple[str, bytes]]:
        assert self.commit is not None
        listing = git_output(self.root, "ls-tree", "-r", "-z", self.commit, "--", path)
        if listing is None:
            raise OSError(f"git cannot list {path} at {self.commit}")
        names, blobs = [], []
        for entry in filter(None, listing.split(b"\0")):
            meta, name = entry.split(b"\t", 1)
            kind, blob = meta.split()[1:3]
            text = name.decode()
            if kind == b"blob" and not any(_ignored(part) for part in Path(text).parts):
                names.append(text)
                blobs.append(blob)
        return list(zip(names, self._blobs(blobs), strict=True))

    def _blobs(self, blobs: Sequence[bytes]) -> list[bytes]:
        """The contents of `blobs`, read with one `git cat-file --batch`."""
        if not blobs:
            return []
        out = git_output(self.root, "cat-file", "--batch", stdin=b"\n".join(blobs) + b"\n")
        if out is None:
            raise OSError(f"git cannot read the files at {self.commit}")
        contents, at = [], 0
        for _ in blobs:  # each: "<sha> blob <size>\n<bytes>\n"
            eol = out.index(b"\n", at)
            size = int(out[at:eol].split()[2])
            contents.append(out[eol + 1 : eol + 1 + size])
            at = eol + 1 + size + 1
        return contents


def record(paths: Sequence[str], tree: Tree | None = None) -> SourceRecord:
    """The digests of `paths` in the working tree (or `tree`), as a run records them."""
    tree = tree or Tree()
    origin = SourceOrigin.RUN if tree.commit is None else SourceOrigin.COMMIT
    return SourceRecord(tree.digests(paths), origin)


def changed(recorded: SourceRecord, now: Tree) -> list[str]:
    """The declared paths whose digest in `now` differs from the recorded one."""
    current = now.digests(list(recorded.digests))
    return [path for path, digest in recorded.digests.items() if current[path] != digest]


def first_change(
    since: str, paths: Sequence[str], head: str, root: Path = SOURCE_ROOT
) -> str | None:
    """The full hash of the first commit after `since` up to `head` that touched any of
    `paths`, or None when git cannot say (no history, or none touched them)."""
    out = git_output(root, "log", "--format=%H", "--reverse", f"{since}..{head}", "--", *paths)
    lines = out.decode().split() if out else []
    return lines[0] if lines else None


def is_shallow(root: Path = SOURCE_ROOT) -> bool:
    """Whether `root` is a shallow clone (history cut off: `first_change` cannot see far
    enough back to date a change)."""
    return git_output(root, "rev-parse", "--is-shallow-repository") == b"true\n"


def git_output(root: Path, *args: str, stdin: bytes | None = None) -> bytes | None:
    """stdout of a read-only git command in `root`, or None if git cannot answer."""
    # GIT_OPTIONAL_LOCKS=0: `git status` must not refresh (and so rewrite) the index.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, env=env, input=stdin, capture_output=True,
            timeout=GIT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
