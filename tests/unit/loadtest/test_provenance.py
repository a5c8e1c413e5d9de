"""Provenance of a result: the commit (read-only git), dirty flag, UTC time and host."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from loadtest.reports import provenance
from loadtest.reports.provenance import Host, Provenance, collect_provenance, cpu_model, describe


def _git_head() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=provenance.SOURCE_ROOT,
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def test_collects_commit_time_command_and_host() -> None:
    p = collect_provenance(["python", "-m", "loadtest.x_bench", "--out", "a b.json"])
    assert p.commit == _git_head()
    if p.commit is not None:
        assert re.fullmatch(r"[0-9a-f]{40}", p.commit)
    taken = datetime.fromisoformat(p.taken_at)
    assert taken.utcoffset() == timedelta(0)
    assert p.command == "python -m loadtest.x_bench --out 'a b.json'"
    assert p.host.hostname and p.host.cpu_model
    assert p.host.cpu_count >= p.host.usable_cpus >= 1


def test_outside_a_checkout_there_is_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(provenance, "SOURCE_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    p = collect_provenance([])
    assert p.commit is None and p.dirty is False


def test_dirty_counts_tracked_changes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "old.json").write_text("{}")
    git("add", "a.txt", "docs")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "one")
    monkeypatch.setattr(provenance, "SOURCE_ROOT", tmp_path)
    (tmp_path / "result.json").write_text("{}")  # untracked: not dirty
    (tmp_path / "docs" / "results" / "old.json").write_text('{"new": 1}')  # a result: not
    clean = collect_provenance([])
    assert clean.commit is not None and not clean.dirty
    (tmp_path / "a.txt").write_text("two\n")
    assert collect_provenance([]).dirty


def test_cpu_model_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU @ 2.0GHz\n")
    assert cpu_model(info) == "Example CPU @ 2.0GHz"
    assert cpu_model(tmp_path / "missing")  # falls back to what platform knows


def test_describe() -> None:
    host = Host("box", "Example CPU", 4, 2, "3.11", "Linux")
    p = Provenance("0123456789abcdef" * 2 + "01234567", True, "2026-01-02T03:04:05+00:00",
                   "python -m loadtest.x_bench", host)  # fmt: skip
    line = describe(p)
    assert "commit 0123456789ab with uncommitted changes" in line
    assert "2026-01-02T03:04:05+00:00 on box (Example CPU; 2 of 4 CPUs usable)" in line
