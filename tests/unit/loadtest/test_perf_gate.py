"""The performance gate fails on a slowed kernel: with every engine step made five times
slower and 0.2 s longer, the engine's figures fall far under their floors, the report
says FAILED and the command exits 1. (Whether the real code passes is the gate's own run
in `make test`, on the host's timing; this test asserts only the direction nothing can
hide.)

The slowdown scales with each step's own time as well as adding a fixed sleep: a fixed
0.2 s alone is a large slowdown at batch 1, where steps are short, but on a host where
batch 16 steps are slow anyway it left that ratio at 0.98 against its 0.95 floor, and
the test failed in CI. A multiple alone leaves batch 1, where most of the engine's time
is outside the step, near its floor."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from engine.model_runner import ModelRunner
from loadtest import perf_gate
from loadtest.engine.workload import PhasePlan

pytestmark = pytest.mark.serial  # it measures time

SLOWDOWN = 5.0  # each step takes this many times its own time...
EXTRA_S = 0.2  # ...and this much longer


def test_a_slowed_kernel_fails_the_gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    execute = ModelRunner.execute

    def slowed(self: ModelRunner, batch: Any) -> Any:
        start = time.perf_counter()
        result = execute(self, batch)
        time.sleep((SLOWDOWN - 1.0) * (time.perf_counter() - start) + EXTRA_S)
        return result

    monkeypatch.setattr(ModelRunner, "execute", slowed)
    small = (PhasePlan(1, 1, (16, 32), (8, 8)), PhasePlan(16, 16, (16, 32), (8, 8)))
    monkeypatch.setattr(perf_gate, "ENGINE_PLANS", small)
    out = tmp_path / "gate.json"
    assert perf_gate.main(["--out", str(out), "--transfer", "false"]) == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["provenance"]["sources"]["digests"]
    engine = [t for t in report["targets"] if t["name"].startswith("engine/")]
    assert [(t["name"], t["met"]) for t in engine] == [
        ("engine/transformers @ batch 1", False),
        ("engine/transformers @ batch 16", False),
    ]
