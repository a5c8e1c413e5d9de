"""The repository's commit-msg hook (.githooks/commit-msg): run on message files as git
runs it, it accepts the house style's messages and refuses the others, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / ".githooks" / "commit-msg"
BODY = "The body says why the change was made.\n"


def _run(tmp_path: Path, message: str) -> subprocess.CompletedProcess[str]:
    """The hook on a file holding `message`, from a directory outside any checkout's
    config that could change the comment character."""
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(
        [sys.executable, str(HOOK), str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_the_hook_is_an_executable_script() -> None:
    assert os.access(HOOK, os.X_OK)
    assert HOOK.read_text().startswith("#!/usr/bin/env python3\n")


def test_a_subject_a_blank_line_and_a_body_pass(tmp_path: Path) -> None:
    got = _run(tmp_path, "engine: state the kernels' contracts\n\n" + BODY)
    assert got.returncode == 0, got.stderr
    assert got.stderr == ""


def test_a_subject_of_72_characters_passes_and_73_fails(tmp_path: Path) -> None:
    assert _run(tmp_path, "x" * 72 + "\n\n" + BODY).returncode == 0
    got = _run(tmp_path, "x" * 73 + "\n\n" + BODY)
    assert got.returncode == 1
    assert "73 characters" in got.stderr and "limit is 72" in got.stderr


def test_characters_not_bytes_are_counted(tmp_path: Path) -> None:
    assert _run(tmp_path, "é" * 72 + "\n\n" + BODY).returncode == 0


def test_a_body_without_a_blank_line_fails(tmp_path: Path) -> None:
    got = _run(tmp_path, "A subject\n" + BODY)
    assert got.returncode == 1
    assert "second line must be blank" in got.stderr


@pytest.mark.parametrize(
    "message",
    ["A subject only\n", "A subject only", "A subject\n\n\n", "A subject\n\n# a comment\n"],
)
def test_a_message_without_a_body_fails(tmp_path: Path, message: str) -> None:
    got = _run(tmp_path, message)
    assert got.returncode == 1
    assert "no body" in got.stderr


@pytest.mark.parametrize(
    "subject",
    [
        "Merge branch 'wt-kernels' into main",
        'Revert "engine: kernel docstrings state contracts; measurements in engine.md"',
        "fixup! engine: kernel docstrings state contracts",
        "squash! engine: kernel docstrings state contracts",
    ],
)
def test_merges_reverts_and_fixups_pass_as_git_writes_them(tmp_path: Path, subject: str) -> None:
    """Subject only, and the revert's over 72 characters: git writes them so."""
    got = _run(tmp_path, subject + "\n")
    assert got.returncode == 0, got.stderr


def test_comment_lines_are_ignored(tmp_path: Path) -> None:
    comments = "# " + "a long comment line that git strips " * 4 + "\n"
    message = comments + "\nA subject\n" + comments + "\n" + BODY + comments
    assert _run(tmp_path, message).returncode == 0
    # Comments are no body, and a comment between subject and body is no blank line.
    assert _run(tmp_path, "A subject\n" + comments).returncode == 1
    got = _run(tmp_path, "A subject\n" + comments + BODY)
    assert got.returncode == 1 and "second line must be blank" in got.stderr


def test_the_verbose_diff_below_the_scissors_is_not_the_body(tmp_path: Path) -> None:
    scissors = "# ------------------------ >8 ------------------------\n"
    diff = "diff --git a/x b/x\n+added line\n"
    assert _run(tmp_path, "A subject\n" + scissors + diff).returncode == 1
    assert _run(tmp_path, "A subject\n\n" + BODY + scissors + diff).returncode == 0


def test_every_problem_is_named(tmp_path: Path) -> None:
    got = _run(tmp_path, "y" * 80 + "\nno blank line before this\n")
    assert got.returncode == 1
    assert "80 characters" in got.stderr and "second line must be blank" in got.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_runs_it_through_core_hooks_path(tmp_path: Path) -> None:
    """As `make install` wires it: a commit in a clone is refused or made by the hook."""
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        **{f"GIT_{who}_{what}": v for who in ("AUTHOR", "COMMITTER")
           for what, v in (("NAME", "Test"), ("EMAIL", "test@example.com"))},
    }  # fmt: skip

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
        )

    assert git("init", "-q").returncode == 0
    shutil.copytree(HOOK.parent, tmp_path / ".githooks")
    assert git("config", "core.hooksPath", ".githooks").returncode == 0
    refused = git("commit", "-q", "--allow-empty", "-m", "A subject only")
    assert refused.returncode != 0 and "no body" in refused.stderr
    made = git("commit", "-q", "--allow-empty", "-m", "A subject", "-m", BODY)
    assert made.returncode == 0, made.stderr
    assert git("log", "--format=%s").stdout == "A subject\n"
