"""Running Prometheus' own `promtool` on what the chart renders, where it is installed.

`check_rules(groups)` parses every expression with Prometheus' PromQL parser;
`run_rule_tests(groups, tests)` evaluates the rules over synthetic series, as Prometheus
would, and checks the alerts that fire and the values expressions return (`promtool
test rules`, prometheus.io/docs/prometheus/latest/configuration/unit_testing_rules).
`make test` installs promtool next to the venv's Python (`install_promtool.py`); it is
looked for there, then on PATH, and the tests that use it skip where it is in neither.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMTOOL = shutil.which("promtool", path=str(Path(sys.executable).parent)) or shutil.which(
    "promtool"
)
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")


def _run(*args: str) -> None:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def check_rules(groups: list[dict[str, Any]], workdir: Path) -> None:
    path = workdir / "check-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    _run("check", "rules", str(path))


def run_rule_tests(
    groups: list[dict[str, Any]], tests: list[dict[str, Any]], workdir: Path
) -> None:
    """Run `tests` (promtool unit-test cases) against `groups` at a 1-minute interval."""
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    path = workdir / "rules-test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    _run("test", "rules", str(path))


def records(exprs: dict[str, str]) -> list[dict[str, Any]]:
    """Bare expressions as one group of recording rules, for `check_rules`."""
    return [{"name": "exprs", "rules": [{"record": k, "expr": v} for k, v in exprs.items()]}]
