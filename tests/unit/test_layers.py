"""The import contracts of docs/design.md: kept by the code, and able to fail.

`make lint` runs `lint-imports` on the tree; these tests run the same contracts here so a
broken layer shows up in the test report too, and prove on a copy of the tree that an
upward import (between packages, or between the gateway's rooms) and a hidden cycle
(behind TYPE_CHECKING) each break them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kvtransfer", "services", "loadtest")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four packages' Python files and pyproject.toml, copied."""
    if not LINT_IMPORTS.exists():
        pytest.skip("lint-imports is not installed (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", root)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_tree_keeps_every_contract(tree_copy: Path) -> None:
    result = _lint(tree_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_an_upward_import_breaks_the_layers(tree_copy: Path) -> None:
    bad = tree_copy / "engine" / "reaches_up.py"
    bad.write_text("from services.gateway import service  # noqa: F401\n")
    try:
        result = _lint(tree_copy)
    finally:
        bad.unlink()
    assert result.returncode == 1
    assert "Imports only point down the layers BROKEN" in result.stdout
    assert "engine.reaches_up -> services.gateway.service" in result.stdout


def test_an_upward_import_between_rooms_breaks_the_gateway_rooms(tree_copy: Path) -> None:
    bad = tree_copy / "services" / "gateway" / "flow" / "reaches_up.py"
    bad.write_text("from services.gateway import client  # noqa: F401\n")
    try:
        result = _lint(tree_copy)
    finally:
        bad.unlink()
    assert result.returncode == 1
    assert "The gateway's rooms only import downward BROKEN" in result.stdout
    assert "services.gateway.flow.reaches_up -> services.gateway.client" in result.stdout


def test_a_cycle_behind_type_checking_breaks_acyclic(tree_copy: Path) -> None:
    a, b = tree_copy / "engine" / "cycle_a.py", tree_copy / "engine" / "cycle_b.py"
    a.write_text("from engine import cycle_b  # noqa: F401\n")
    b.write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from engine import cycle_a\n"
    )
    try:
        result = _lint(tree_copy)
    finally:
        a.unlink()
        b.unlink()
    assert result.returncode == 1
    assert "No import cycle between the modules of any package BROKEN" in result.stdout
    assert "cycle_" in result.stdout
