"""What lets a test file into `make test`'s pairable phase (two files at a time): it lives
outside tests/unit (unit tests have their own phase) and asserts no duration, because a
second cluster on the same cores stretches every duration. A wait that only catches a
hang (`assert time.monotonic() < end`) is allowed; a measured one is not:
`assert time.monotonic() - start < 2.0`, or any assertion on a name holding "elapsed".
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLOCKS = {"monotonic", "perf_counter", "time"}


def _is_pairable(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return "pairable" in ast.unparse(node.value)
    return False


def _reads_clock(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCKS
    )


def _measures(node: ast.expr) -> bool:
    """Whether an assertion's test is a duration: a clock reading minus something, or a
    name that says it is one."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub) and _reads_clock(sub.left):
            return True
        if isinstance(sub, ast.Name) and "elapsed" in sub.id:
            return True
    return False


def duration_asserts(source: str) -> list[int]:
    """Line numbers of the assertions in `source` that measure a duration."""
    tree = ast.parse(source)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and _measures(n.test)]


def _pairable_files() -> list[Path]:
    return [
        p
        for p in sorted((ROOT / "tests").rglob("test_*.py"))
        if _is_pairable(ast.parse(p.read_text()))
    ]


def test_pairable_files_are_integration_files_that_measure_no_duration() -> None:
    files = _pairable_files()
    assert len(files) >= 10  # the phase exists and holds what make test expects of it
    for path in files:
        assert (ROOT / "tests" / "unit") not in path.parents, path
        assert duration_asserts(path.read_text()) == [], path


def test_the_duration_check_bites() -> None:
    source = (
        "import time\n"
        "start = time.monotonic()\n"
        "assert time.monotonic() - start < 2.0\n"
        "elapsed = 1.0\n"
        "assert elapsed < 2.5\n"
        "end = time.monotonic() + 10\n"
        "assert time.monotonic() < end, 'a hang'\n"
    )
    assert duration_asserts(source) == [3, 5]
