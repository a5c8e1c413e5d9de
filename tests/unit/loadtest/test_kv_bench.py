"""The KV memory benchmark: capacity per cache dtype, the offload TTFT on a short prompt,
the targets and the results page section (the throughput part is `make bench`'s)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from engine.model_spec import ModelSpec
from loadtest.engine import kv_bench
from loadtest.engine.kv_bench import (
    KvBenchReport,
    ThroughputRow,
    evaluate,
    measure_capacity,
    measure_offload,
)
from loadtest.reports.sections import section


def test_capacity_counts_the_engines_own_blocks(model_dir: Path) -> None:
    rows = {r.cache: r for r in measure_capacity(ModelSpec.from_dir(model_dir), 256 << 20)}
    assert rows["float32"].bytes_per_block == 2 * rows["bfloat16"].bytes_per_block
    # 8 bits plus in-block scales: a little over half of bf16's bytes.
    assert 0.5 < rows["int8"].bytes_per_block / rows["bfloat16"].bytes_per_block < 0.51
    assert rows["int8"].vs_bfloat16 >= 1.9 and rows["fp8_e4m3"].vs_float32 >= 3.5


def test_offload_ttft_of_an_evicted_prompt(model_dir: Path) -> None:
    result = measure_offload(str(model_dir), threads=1, reps=1, seed=0, tokens=480)
    assert result.pool_blocks == kv_bench.offload_pool_blocks(480) == 30 + 3 + 2
    assert result.restored_blocks >= 20  # most of the prompt came back from the tier
    assert len(result.recompute_ttft_s) == len(result.tier_ttft_s) == 1
    assert 0 < result.ttft_ratio < 1


def test_targets_and_the_results_section(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    assert kv_bench.main(["--out", str(out), "--parts", "capacity"]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "pdserve.kv_bench/1" and data["provenance"]["commit"]
    assert data["targets_met"] and len(data["targets"]) == 4  # two ratios per 8-bit dtype
    text = "\n".join(section(data, "kv.json"))
    assert "KV memory" in text and "| int8 | int8 |" in text
    rows = [ThroughputRow("auto", [10.0], 10.0, 1.0, [1.0], 1.0),
            ThroughputRow("int8", [8.0], 8.0, 0.8, [0.8], 0.8)]  # fmt: skip
    slow = KvBenchReport("s", 1, "bfloat16", 1, throughput=rows)
    (target,) = evaluate(slow)
    assert target.name == "int8 tok/s @32 / unquantized" and not target.met
    data["throughput"] = [dataclasses.asdict(r) for r in rows]
    assert "| int8 | 8.0 | 0.80x | 8.0 | 0.80x | 0.80x |" in "\n".join(section(data, "kv.json"))


def test_each_round_rotates_which_side_runs_first() -> None:
    orders = [kv_bench.round_order(r) for r in range(4)]
    assert [o[0] for o in orders[:3]] == list(kv_bench.CACHE_DTYPES)
    assert orders[3] == orders[0] and all(sorted(o) == sorted(orders[0]) for o in orders)


def _half(x: float) -> float:
    return x / 2


def _raise() -> float:
    raise ValueError("no engine")


def _die() -> float:
    os._exit(3)


def _hang() -> float:
    time.sleep(60)
    return 0.0


def test_a_run_in_its_own_process_returns_or_fails_clearly_and_leaves_nothing() -> None:
    assert kv_bench.run_isolated(_half, (3.0,), 60) == 1.5
    with pytest.raises(RuntimeError, match="ValueError: no engine"):
        kv_bench.run_isolated(_raise, (), 60)
    with pytest.raises(RuntimeError, match="exit code 3"):
        kv_bench.run_isolated(_die, (), 60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 2 s"):
        kv_bench.run_isolated(_hang, (), 2)
    assert time.monotonic() - start < 30  # killed, not waited for
    assert not multiprocessing.active_children()
