"""The engine benchmark end to end in its smoke preset, on the real default model.

One module-scoped run converts the default model into a temporary cache, runs every side
(pdserve in bf16 and in float32, transformers static and continuous batching) at batch 1
and 2 on two tiny requests each, and writes the JSON; the tests then check its schema
and that its numbers add up against the workload the bench draws. The bench itself
raises if pdserve leaves blocks or requests behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.model_spec import ModelSpec
from loadtest.engine import bench_report as engine_report
from loadtest.engine import workload as engine_workload
from loadtest.engine.bench import main, parse_args
from loadtest.engine.workload import PRESETS, PhasePlan, log_uniform, make_workload

pytest.importorskip("transformers")

SMOKE = PRESETS["smoke"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    cache = tmp_path_factory.mktemp("model-cache")
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    threads = torch.get_num_threads()
    argv = ["--smoke", "--model-cache-dir", str(cache), "--out", str(out), "--threads", "1"]
    argv += ["--kv-cache-bytes", str(64 << 20), "--dtype", "bfloat16"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            rc = main(argv)
    finally:
        torch.set_num_threads(threads)  # the bench sets it process-wide
    assert rc == 0
    return json.loads(out.read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def report(bench_run: tuple[dict[str, Any], str]) -> dict[str, Any]:
    return bench_run[0]


def test_top_level_schema(report: dict[str, Any]) -> None:
    assert report["schema"] == engine_report.SCHEMA
    assert set(report) == {
        "schema",
        "provenance",
        "settings",
        "started_at",
        "finished_at",
        "wall_s",
        "model_dir",
        "machine",
        "config",
        "kv",
        "phases",
        "targets_met",
    }
    started = datetime.fromisoformat(report["started_at"])
    finished = datetime.fromisoformat(report["finished_at"])
    assert started <= finished
    assert report["wall_s"] > 0
    assert report["machine"]["torch_threads"] == report["config"]["threads"] == 1
    assert report["provenance"]["host"]["cpu_count"] >= 1
    assert report["config"]["preset"] == "smoke"
    assert report["config"]["dtype"] == report["machine"]["dtype"] == "bfloat16"
    assert [p["batch_size"] for p in report["phases"]] == [1, 2]


def test_kv_pool_numbers(report: dict[str, Any]) -> None:
    spec = ModelSpec.from_dir(Path(report["model_dir"]))
    kv = report["kv"]
    # bf16 K and V for every layer and KV head.
    assert kv["bytes_per_token"] == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    assert kv["pool_tokens"] == kv["total_blocks"] * kv["block_size"]
    assert kv["pool_bytes"] == kv["pool_tokens"] * kv["bytes_per_token"]
    assert kv["pool_bytes"] <= 64 << 20
    assert math.isclose(kv["pool_mib"], kv["pool_bytes"] / 2**20)


def test_token_counts_add_up(report: dict[str, Any]) -> None:
    spec = ModelSpec.from_dir(Path(report["model_dir"]))
    for plan, phase in zip(SMOKE, report["phases"], strict=True):
        requests = make_workload(plan, spec.vocab_size, seed=report["settings"]["seed"])
        outputs = sum(r.max_tokens for r in requests)
        prompts = sum(len(r.prompt) for r in requests)
        assert phase["batch_size"] == plan.batch_size
        assert phase["num_requests"] == len(requests) == plan.num_requests
        assert phase["output_tokens"] == outputs
        assert phase["prompt_tokens"] == prompts
        for side in ("pdserve", "transformers", "transformers_cb", "pdserve_fp32"):
            s = phase[side]
            assert s["output_tokens"] == outputs
            assert s["prompt_tokens"] == prompts
            assert s["wall_s"] > 0
            assert math.isclose(s["tokens_per_s"], outputs / s["wall_s"])
            assert math.isclose(s["total_tokens_per_s"], (outputs + prompts) / s["wall_s"])
        pd, hf = phase["pdserve"], phase["transformers"]
        # pdserve runs every prompt token and every output but the last, exactly once.
        assert pd["computed_tokens"] == prompts + outputs - len(requests)
        # A static batch also runs padding and the shorter requests' overrun.
        assert hf["computed_tokens"] >= pd["computed_tokens"]
        b = plan.batch_size
        batches = [requests[i : i + b] for i in range(0, len(requests), b)]
        assert hf["forward_passes"] == sum(max(r.max_tokens for r in b) for b in batches)
        assert pd["forward_passes"] >= max(r.max_tokens for r in requests)
        assert phase["preemptions"] == 0
        assert phase["prefix_hit_tokens"] == 0


def test_ratios_and_targets(report: dict[str, Any]) -> None:
    for phase in report["phases"]:
        pd, hf = phase["pdserve"], phase["transformers"]
        assert phase["ratio"] > 0
        assert math.isclose(phase["ratio"], pd["tokens_per_s"] / hf["tokens_per_s"])
        assert 0.0 <= phase["greedy_agreement"] <= 1.0
        assert phase["load_before"] >= 0 and phase["load_after"] >= 0
        target = engine_report.TARGETS.get(phase["batch_size"])
        assert phase["target"] == target
        assert phase["met"] == (None if target is None else phase["ratio"] >= target)
        cb, fp32 = phase["transformers_cb"], phase["pdserve_fp32"]
        assert math.isclose(phase["cb_ratio"], pd["tokens_per_s"] / cb["tokens_per_s"])
        assert phase["cb_met"] == (phase["cb_ratio"] >= engine_report.CB_TARGET)
        assert math.isclose(phase["dtype_ratio"], pd["tokens_per_s"] / fp32["tokens_per_s"])
        assert phase["dtype_target"] == engine_report.DTYPE_TARGETS.get(phase["batch_size"])
    verdicts = [p[k] for p in report["phases"] for k in ("met", "cb_met", "dtype_met")]
    assert report["targets_met"] == all(v is not False for v in verdicts)


def test_table_printed(bench_run: tuple[dict[str, Any], str]) -> None:
    report, table = bench_run
    lines = table.splitlines()
    assert "pdserve tok/s" in lines[0] and "transformers tok/s" in lines[0]
    for phase in report["phases"]:
        row = next(line for line in lines if line.split()[:1] == [str(phase["batch_size"])])
        assert f"{phase['ratio']:.2f}x" in row
    kv = report["kv"]
    assert any(f"{kv['bytes_per_token']} bytes/token" in line for line in lines)
    assert any(f"{kv['total_blocks']} blocks" in line for line in lines)


def test_log_uniform_bounds_and_shape() -> None:
    rng = np.random.default_rng(0)
    draws = log_uniform(rng, 16, 1024, 20_000)
    assert min(draws) >= 16 and max(draws) <= 1024
    logs = np.log(np.array(draws, dtype=float))
    # Log-uniform: the log's median sits midway between the bounds' logs.
    assert abs(float(np.median(logs)) - (math.log(16) + math.log(1025)) / 2) < 0.1


def test_workload_is_seeded_and_in_range() -> None:
    plan = PhasePlan(4, 8)
    a = make_workload(plan, 49152, seed=3)
    assert a == make_workload(plan, 49152, seed=3)
    assert a != make_workload(plan, 49152, seed=4)
    for r in a:
        assert 16 <= len(r.prompt) <= 1024 and 16 <= r.max_tokens <= 256
        assert all(engine_workload.FIRST_REGULAR_ID <= t < 49152 for t in r.prompt)


def test_presets_from_flags() -> None:
    settings, cfg = parse_args([])
    assert cfg.preset == "short" and settings.out == Path("bench-results/engine.json")
    assert parse_args(["--full"])[1].preset == "full"
    assert parse_args(["--preset", "smoke"])[1].phases == SMOKE
    assert [p.batch_size for p in cfg.phases] == [1, 8, 32]
    assert parse_args(["--no-warmup"])[1].warmup is False
    for bad in (["--full", "--smoke"], ["--preset", "huge"], ["--threads", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
