"""Which processes load torch: workers do; the gateway, the router and the `pdserve`
command's own start do not (torch costs about 3 s and 250 MB RSS at every start, and a
gateway pod never computes). A module that brings torch into one of them fails here,
naming the import chain's first step."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import builtins, importlib, sys, traceback
first = []
real = builtins.__import__
def spy(name, *args, **kwargs):
    if name.partition(".")[0] == "torch" and "torch" not in sys.modules and not first:
        first.append([f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()
                      if "site-packages" not in f.filename][-4:])
    return real(name, *args, **kwargs)
builtins.__import__ = spy
importlib.import_module(sys.argv[1])
print(first[0] if first else "")
"""


@pytest.mark.parametrize(
    "module",
    ["services.gateway.server", "services.router.service", "services.cli.main"],
)
def test_the_module_does_not_import_torch(module: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "", f"{module} imports torch via {run.stdout}"


def test_the_worker_does_import_torch() -> None:
    """The probe sees an import when there is one."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE, "services.worker.server"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "engine" in run.stdout
