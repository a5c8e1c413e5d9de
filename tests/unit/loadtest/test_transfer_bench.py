"""The transfer benchmark end to end in a tiny mode, plus its pure helpers.

One module-scoped run moves the KV of a 32-token prompt (2 blocks of the default model's
layout) between this process and a real exporter process over NIXL and the TCP fallback,
two repetitions each and a short one-block series, and writes the JSON; the tests then
check its schema, that its numbers add up, that every import was verified bitwise and
every lease released, and that the exporter process is gone.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.kv_layout import KV_LAYOUT_VERSION
from kvtransfer.service import CHUNK_BYTES
from loadtest.transfer import report as transfer_report
from loadtest.transfer.bench import main, parse_args
from loadtest.transfer.config import HEADROOM_BLOCKS, TransferBenchConfig
from loadtest.transfer.exporter import BLOCK_SIZE, PinnedRanges, layout_for, patterned_pool
from loadtest.transfer.measure import block_ids, merged_descriptors
from loadtest.transfer.peer import ExporterPeer

TOKENS = 32


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "transfer.json"
    argv = ["--tokens", str(TOKENS), "--reps", "2", "--overhead-reps", "10", "--out", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(argv)
    assert rc == 0
    return json.loads(out.read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def report(bench_run: tuple[dict[str, Any], str]) -> dict[str, Any]:
    return bench_run[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_schema_and_config(report: dict[str, Any]) -> None:
    assert report["schema"] == transfer_report.SCHEMA
    for key in ("provenance", "started_at", "finished_at", "wall_s", "model_dir",
                "exporter_pid", "machine", "layout", "settings", "config", "cases", "one_block",
                "leases", "verified", "leases_clean", "targets", "targets_met"):  # fmt: skip
        assert key in report
    assert report["wall_s"] > 0
    assert report["config"]["tokens"] == str(TOKENS)
    assert report["config"]["reps"] == report["config"]["tcp_reps"] == 2  # resolved
    assert report["provenance"]["host"]["cpu_count"] >= 1
    machine = report["machine"]
    assert len(machine["loadavg_start"]) == 3 and isinstance(machine["transport_env"], dict)
    assert machine["torch_threads"] == 1  # the memcpy baseline is single-threaded


def test_cases_add_up(report: dict[str, Any]) -> None:
    layout = report["layout"]
    blocks = TOKENS // BLOCK_SIZE
    per_message = max(1, CHUNK_BYTES // layout["bytes_per_block"])
    assert layout["layout_version"] == KV_LAYOUT_VERSION
    assert [(c["tokens"], c["pattern"]) for c in report["cases"]] == [
        (TOKENS, "contig"),
        (TOKENS, "scatter"),
    ]
    for c in report["cases"]:
        assert c["blocks"] == blocks
        assert (
            c["bytes"] == blocks * layout["bytes_per_block"] == TOKENS * layout["bytes_per_token"]
        )
        for side in ("memcpy", "torch_copy", "nixl", "nixl_checked", "tcp"):
            assert c[f"{side}_gbps"] > 0
            assert len(c["seconds"][side]) == 2
        checked, plain = c["seconds"]["nixl_checked"], c["seconds"]["nixl"]
        paired = [a / b for a, b in zip(checked, plain, strict=True)]
        assert math.isclose(c["checked_vs_plain"], statistics.median(paired))
        assert c["verify_wait_ms"] >= 0 and c["export_hash_ms"] > 0
        assert math.isclose(c["nixl_vs_memcpy"], c["nixl_gbps"] / c["memcpy_gbps"])
        assert math.isclose(c["nixl_vs_torch_copy"], c["nixl_gbps"] / c["torch_copy_gbps"])
        assert math.isclose(c["nixl_vs_tcp"], c["nixl_gbps"] / c["tcp_gbps"])
        assert c["nixl_unit_descriptors"] == blocks  # block-major: one per block
        assert c["tcp_messages"] == -(-blocks // per_message)
        assert c["verified"] == {"nixl": True, "tcp": True, "nixl_checked": True}
    contig = report["cases"][0]
    assert contig["nixl_merged_descriptors"] == 1  # one run of adjacent blocks


def test_one_block_overhead(report: dict[str, Any]) -> None:
    assert [o["backend"] for o in report["one_block"]] == ["nixl", "tcp"]
    for o in report["one_block"]:
        assert o["reps"] == 10 and o["verified"]
        assert o["bytes"] == report["layout"]["bytes_per_block"]
        assert 0 < o["median_ms"] <= o["p99_ms"]


def test_verified_and_no_lease_left(report: dict[str, Any]) -> None:
    assert report["verified"] and report["leases_clean"]
    for counts in report["leases"].values():
        assert counts["active"] == counts["expired"] == 0
        assert counts["released"] == counts["granted"] > 0


def test_targets(report: dict[str, Any]) -> None:
    # No 8192-token case in this mode: only the one-block target is evaluated.
    assert [t["name"] for t in report["targets"]] == ["nixl one-block median ms"]
    target = report["targets"][0]
    assert target["met"] == (target["measured"] <= transfer_report.TARGET_ONE_BLOCK_MS)
    assert report["targets_met"] == target["met"]


def test_exporter_process_is_gone(report: dict[str, Any]) -> None:
    assert _gone(report["exporter_pid"])


def test_table_printed(bench_run: tuple[dict[str, Any], str]) -> None:
    report, table = bench_run
    assert "nixl/memcpy" in table and "nixl descs" in table and "checked/plain" in table
    for c in report["cases"]:
        row = next(
            line for line in table.splitlines() if line.split()[:2] == [str(TOKENS), c["pattern"]]
        )
        assert f"{c['nixl_vs_memcpy']:.2f}x" in row
        assert f"{c['nixl_unit_descriptors']}->{c['nixl_merged_descriptors']}" in row
    assert "one-block import (read + release) nixl" in table


def test_exporter_killed_when_it_does_not_answer(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with pytest.raises(TimeoutError):
        ExporterPeer(model_dir, num_blocks=4, timeout_s=0.01)
    assert len(started) == 1 and _gone(started[0].pid)


def test_merged_descriptors_and_block_ids() -> None:
    assert merged_descriptors([5, 6, 7], [1, 2, 3]) == 1
    assert merged_descriptors([3, 7, 8], [10, 11, 12]) == 2
    src, dst = block_ids("contig", 4, 20, seed=0)
    assert src == [8, 9, 10, 11] and dst == [4, 5, 6, 7]
    src, dst = block_ids("scatter", 6, 20, seed=0)
    assert len(set(src)) == len(set(dst)) == 6 and max(src + dst) < 20
    assert (src, dst) == block_ids("scatter", 6, 20, seed=0)


def test_pinned_ranges_release_once(model_dir: Path) -> None:
    layout = layout_for(model_dir)
    pinned = PinnedRanges(layout, patterned_pool(layout, 8))
    pinned.pin("r", [3, 4])
    held = pinned.held_kv("r")
    assert held.block_ids == [3, 4] and held.num_tokens == 2 * BLOCK_SIZE
    assert pinned.release_held("r") and not pinned.release_held("r")
    assert len(pinned) == 0


def test_config_from_flags() -> None:
    settings, cfg = parse_args(["--tokens", "16,64", "--reps", "3", "--seed", "2"])
    assert cfg.token_counts == (16, 64) and cfg.tcp_rep_count == 3 and settings.seed == 2
    assert cfg.num_blocks == 4 + HEADROOM_BLOCKS
    assert parse_args([])[1].token_counts == (512, 2048, 8192)
    assert parse_args([])[1].tcp_rep_count == 5
    assert parse_args(["--tcp-reps", "2"])[1].tcp_rep_count == 2
    with pytest.raises(ValueError):
        TransferBenchConfig(tokens="16", reps=2, tcp_reps=3)
    with pytest.raises(SystemExit):
        parse_args(["--tokens", "16,x"])
