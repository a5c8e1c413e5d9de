"""The multi-LoRA benchmark, shortened: its adapters are real PEFT-layout adapters of
both shapes, every side reports tokens/s against the base's in the same run, and the
results page renders it (the real run is `make bench`'s)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.adapter_ref import available_adapters
from engine.model_spec import ModelSpec
from loadtest.engine import lora_bench
from loadtest.reports.provenance import collect_provenance
from loadtest.reports.result_file import read_result, write_result
from loadtest.reports.sections import section


def test_the_adapters_are_peft_shaped(tmp_path: Path, model_dir: Path) -> None:
    spec = ModelSpec.from_dir(model_dir, hash_weights=False)
    shape = lora_bench.SHAPES[0]
    lora_bench.write_adapter(tmp_path / "a", spec, shape, torch.Generator().manual_seed(0))
    assert available_adapters(tmp_path) == ["a"]
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == shape.rank and config["target_modules"] == list(shape.targets)


def test_a_short_run_reports_every_shape_against_the_base(tmp_path: Path) -> None:
    report = lora_bench.measure(batch=4, max_tokens=3, reps=2, threads=0)
    assert [s.name for s in report.sides] == ["base", "qv-r8", "all-linear-r16"]
    base = report.sides[0]
    for s in report.sides:
        assert s.tokens_per_s > 0 and s.ratio == s.tokens_per_s / base.tokens_per_s
        pairs = [mine / theirs for mine, theirs in zip(s.rounds, base.rounds, strict=True)]
        assert len(pairs) == 2 and s.paired_ratio == sum(pairs) / 2  # the median of two
    assert [t.threshold for t in report.targets] == [0.8, 0.8]
    out = write_result(tmp_path / "lora.json", report, collect_provenance(["lora_bench"]))
    lines = section(read_result(out), "lora.json")
    assert lines[0].startswith("## Multi-LoRA")
    assert any(line.startswith("| qv-r8 |") for line in lines)
    assert any("mixed / base tokens/s" in line for line in lines)
