"""The shifting-workload and peer sections of docs/benchmarks.md: each renders its paired
rounds' ratios from the file, is found where the committed result lies below
docs/results/, and says so when it is stale; the page's discovery lists those files and
nothing else below the top."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.reports.elastic_sections import peer, shifting
from loadtest.reports.results import EXTRA_RESULTS, render, result_paths
from loadtest.reports.stale import StaleResult
from tests.unit.loadtest.measured_tree import SOURCES, measured_tree

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
SHIFTING = Path("elastic/issue41/shifting/shifting.json")
PEER = Path("peer/peer.json")
PROVENANCE = {
    "commit": "ef" * 20,
    "dirty": False,
    "taken_at": "2026-02-03T04:05:06+00:00",
    "command": "python -m loadtest.headline.shifting",
    "host": {"hostname": "bench-host", "cpu_model": "Example CPU", "cpu_count": 2,
             "usable_cpus": 2},
    "sources": SOURCES.to_json(),
}  # fmt: skip


def _phase(sent: int, attainment: float, goodput: float) -> dict[str, Any]:
    return {"sent": sent, "attainment": attainment, "goodput": goodput, "ttft_p50_ms": 700.0,
            "ttft_p90_ms": 1800.0, "itl_p50_ms": 240.0, "itl_p90_ms": 400.0}  # fmt: skip


def _system(name: str, prefill: int, goodput: float) -> dict[str, Any]:
    phases = [_phase(10, 0.9, goodput), _phase(4, 0.5, goodput / 2)]
    return {
        "name": name,
        "cluster": {"num_prefill": prefill, "num_decode": 1 if prefill else 2},
        "unloaded_step_ms": 150.4,
        "scales": [{"scale": 1.0, "rounds": 2, "whole": _phase(14, 0.8, goodput),
                    "phases": phases}],
        "capacity_scale": None,
    }  # fmt: skip


def _shifting_data() -> dict[str, Any]:
    basis = ("goodput over the whole schedule at rate scale 1: elastic / the better of "
             "static and colocated, median of paired rounds")  # fmt: skip
    return {
        "schema": "pdserve.shifting/1",
        "provenance": PROVENANCE,
        "config": {"rounds": 2, "rate_scales": "1", "itl_slo_ms": 0.0,
                   "itl_slo_step_factor": 3.0},
        "phases": [{"long_fraction": 0.0, "rate": 0.5, "start_s": 0.0, "end_s": 120.0},
                   {"long_fraction": 0.5, "rate": 0.15, "start_s": 120.0, "end_s": 240.0}],
        "slo": {"ttft_ms": 2000.0, "ttft_ms_per_token": 12.0, "itl_ms": 451.0,
                "itl_quantile": 0.9},
        "systems": [_system("elastic", 1, 0.3), _system("static", 1, 0.1),
                    _system("colocated", 0, 0.28)],
        "ratios": [
            {"scale": 1.0, "other": "static", "whole": 3.0, "phases": [2.5, 0.8],
             "rounds": [2.0, 4.0]},
            {"scale": 1.0, "other": "best", "whole": 1.05, "phases": [0.9, None],
             "rounds": [0.95, 1.15]},
        ],
        "ratio": 1.05,
        "ratio_basis": basis,
        "targets": [{"name": "shifting workload elastic / better of static and colocated",
                     "measured": 1.05, "threshold": 1.2, "comparison": ">=", "met": False,
                     "context": basis}],
    }  # fmt: skip


def _point(server: str, streams: int, rnd: int, tok_s: float) -> dict[str, Any]:
    return {"server": server, "streams": streams, "round": rnd, "output_tok_s": tok_s}


def _peer_data() -> dict[str, Any]:
    summaries = [
        {"server": "pdserve", "streams": 16, "rounds": 2, "output_tok_s": 90.0,
         "ttft_p50_ms": 900.0, "itl_p50_ms": 150.0, "tpot_p50_ms": 160.0, "errors": 0},
        {"server": "llama.cpp", "streams": 16, "rounds": 2, "output_tok_s": 60.0,
         "ttft_p50_ms": 1000.0, "itl_p50_ms": 140.0, "tpot_p50_ms": 170.0, "errors": 0},
    ]  # fmt: skip
    return {
        "schema": "pdserve.peer_bench/1",
        "provenance": {**PROVENANCE, "command": "python -m loadtest.peer.bench"},
        "config": {"rounds": 2, "prompt_tokens": 256, "output_tokens": 128,
                   "llama_threads": 2, "llama_slots": 16},
        "llama_cpp_python_version": "0.3.36",
        "pdserve_cluster": "1 prefill + 1 decode worker",
        # Listed out of order: the section shows them by round.
        "rounds": [_point("pdserve", 16, 1, 95.0), _point("pdserve", 16, 0, 85.0),
                   _point("llama.cpp", 16, 0, 59.0), _point("llama.cpp", 16, 1, 61.0)],
        "summaries": summaries,
        "comparisons": [{"streams": 16, "output_tok_s_ratio": 1.52, "ttft_p50_ratio": 0.9,
                         "itl_p50_ratio": 1.07, "pdserve_errors": 0, "llama_errors": 0}],
        "targets": [{"name": "16 streams: output tok/s / llama.cpp's, TTFT p50 no worse",
                     "measured": 1.52, "comparison": ">=", "threshold": 1.5, "met": True,
                     "context": "TTFT p50 ratio 0.90x (wanted <= 1.00x)"}],
        "gap_breakdown": {"tpot_http_ms": 128.0, "tpot_grpc_ms": 126.0, "decode_step_ms": 120.0,
                          "serving_path_ms": 8.0, "serving_path_share": 0.0625,
                          "http_front_door_ms": 2.0, "grpc_path_ms": 6.0, "llama_tpot_ms": 33.0,
                          "llama_ms_per_token": 32.5, "llama_serving_path_ms": 0.5},
    }  # fmt: skip


def _write(results: Path, where: Path, data: dict[str, Any]) -> None:
    path = results / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def _section(page: str, title: str) -> str:
    start = page.index(f"## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)]


def test_shifting_prints_the_paired_rounds_beside_their_medians() -> None:
    text = "\n".join(shifting(_shifting_data()))
    assert "Phases at rate scale 1: 1 chat 0-120 s at 0.5 req/s; 2 50% long 120-240 s" in text
    assert "<= 451 ms (3x the unloaded decode step measured in the run)" in text
    assert "Deployments elastic (1P+1D), static (1P+1D), colocated (2 mixed)" in text
    assert "- judged ratio **1.05x**: goodput over the whole schedule at rate scale 1" in text
    header = "| goodput | rate scale | whole: round by round | whole: median | 1 chat: median |"
    assert header in text
    assert "| elastic / static | 1 | 2.00x, 4.00x | 3.00x | 2.50x | 0.80x |" in text
    assert "| elastic / the better other | 1 | 0.95x, 1.15x | 1.05x | 0.90x | - |" in text
    assert "| 1 | 2 50% long | colocated | 2 | 4 | 0.50 | 0.140 | 700 / 1800 | 240 / 400 |" in text
    assert "| 1 | whole | static | 2 | 14 | 0.80 | 0.100 |" in text


def test_peer_prints_each_round_and_the_median_of_the_paired_ratios() -> None:
    text = "\n".join(peer(_peer_data()))
    assert "3 paired rounds" not in text and "2 paired rounds" in text
    assert "| 16 | pdserve | 90.0 | 85.0, 95.0 | 900 | 150.0 | 160.0 | 0 |" in text
    assert "| 16 | llama.cpp | 60.0 | 59.0, 61.0 | 1000 | 140.0 | 170.0 | 0 |" in text
    assert "| 16 | 1.52x | 0.90x | 1.07x | 0 / 0 |" in text
    assert "| serving path = TPOT - step | 8.00 (6% of the TPOT) |" in text
    gapless = {k: v for k, v in _peer_data().items() if k != "gap_breakdown"}
    assert "inter-token gap" not in "\n".join(peer(gapless))


def test_both_are_found_below_the_results_and_marked_when_stale(tmp_path: Path) -> None:
    _write(tmp_path, SHIFTING, _shifting_data())
    _write(tmp_path, PEER, _peer_data())
    fresh = render(tmp_path, tmp_path.parent, {}, measured_tree(tmp_path / "src"))
    shift = _section(fresh, "Shifting workload: elastic roles vs static and colocated")
    link = f"{tmp_path.name}/elastic/issue41/shifting/shifting.json"
    assert f"File [{link}]({link})" in shift
    assert "Taken 2026-02-03T04:05:06+00:00 on commit `efefefefefef`, host bench-host" in shift
    assert "| 1.050 | >= 1.2 | **not met** |" in shift and "Not current" not in shift
    peer_section = _section(fresh, "Peer: pdserve against llama.cpp's llama-server")
    assert "| 1.520 | >= 1.5 | met |" in peer_section
    assert "Targets met in the current results: 1 of 2." in fresh

    old = "before the workers measured their prefill speed; not re-run"
    stale = {
        "shifting": StaleResult("shifting", "ab" * 20, old),
        "peer": StaleResult("peer", "ab" * 20, old),
    }
    page = render(tmp_path, tmp_path.parent, stale, measured_tree(tmp_path / "src"))
    for title in ("Shifting workload: elastic roles vs static and colocated",
                  "Peer: pdserve against llama.cpp's llama-server"):  # fmt: skip
        section = _section(page, title)
        assert f"**Not current.** Stale since `abababababab`: {old}." in section
        assert "| not current |" in section and "| met |" not in section
    assert "| elastic / the better other | 1 | 0.95x, 1.15x | 1.05x |" in page
    assert "Targets met in the current results: 0 of 0." in page
    assert "their targets are not counted): peer, shifting." in page


def test_only_the_listed_files_below_the_top_are_quoted(tmp_path: Path) -> None:
    _write(tmp_path, PEER, _peer_data())
    _write(tmp_path, Path("ab/issue40/base_peer.json"), _peer_data())  # an A/B run: not quoted
    _write(tmp_path, Path("top.json"), {**_peer_data(), "schema": "pdserve.new/1"})
    assert result_paths(tmp_path) == [tmp_path / "top.json", tmp_path / PEER]
    assert PEER in EXTRA_RESULTS and SHIFTING in EXTRA_RESULTS
    _write(tmp_path, Path("peer.json"), _peer_data())  # the same name as peer/peer.json
    with pytest.raises(ValueError, match="share the result name 'peer'"):
        result_paths(tmp_path)


def test_the_committed_results_below_the_top_are_quoted() -> None:
    found = result_paths(RESULTS)
    for extra in EXTRA_RESULTS:
        assert RESULTS / extra in found, extra
    schemas = {json.loads(p.read_text())["schema"] for p in found}
    assert {"pdserve.shifting/1", "pdserve.peer_bench/1"} <= schemas
