"""`pdserve-bench` end to end against a real local cluster (1 prefill + 1 decode worker,
pinned to a core each, Redis placement, KV over NIXL, the default model).

A short Poisson sweep of the long-prompt mix and a closed-loop trace replay run through
the real CLI; the tests check the results file (schema, counts that add up, monotonic
timestamps, attainment in [0, 1], prefix hits from the shared system prompts), that the
plots exist and open, and that the workers really run on one core each.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from loadtest.harness.cli import main
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from tests.conftest import MODEL_CACHE
from tests.integration.pins import Pin

# Runs beside one other pairable file in make test (tests/conftest.py).
# Pins (tests/integration/pins.py): every record names prefill-0, and the cost counts
# workers by role.
pytestmark = [pytest.mark.pairable, pytest.mark.pins(Pin.PREFILL_HOP, Pin.FIXED_ROLES)]

NUM_REQUESTS = 8
RATES = (2.0, 4.0)
PLOTS = ("ttft_cdf", "itl_cdf", "goodput_vs_rate", "attainment_vs_rate")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        ClusterConfig(
            gateway_port=0,
            model_cache_dir=MODEL_CACHE,
            worker_kv_cache_bytes=96 << 20,
            pin_workers=True,
        )
    )
    c.start()
    yield c
    c.stop()


def _bench(cluster: LocalCluster, out: Path, *flags: str) -> int:
    return main(
        [
            "--gateway",
            cluster.gateway_address,
            "--out-dir",
            str(out),
            "--model-cache-dir",
            str(MODEL_CACHE),
            "--progress",
            "false",
            "--warmup-requests",
            "1",
            *flags,
        ]
    )


@pytest.fixture(scope="module")
def sweep(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    rc = _bench(
        cluster,
        out,
        "--workload",
        "long_mix",
        "--rates",
        ",".join(map(str, RATES)),
        "--num-requests",
        str(NUM_REQUESTS),
        "--duration-s",
        "30",
        "--request-timeout-s",
        "60",
        "--long-fraction",
        "0.25",
        "--long-prompt-tokens",
        "200-300",
        "--long-output-tokens",
        "2-4",
        "--tenants",
        "2",
        "--prompts-per-tenant",
        "2",
        "--system-tokens",
        "48-64",
        "--user-tokens",
        "4-8",
        "--chat-output-tokens",
        "6-10",
        "--ttft-slo-ms",
        "3000",
        "--node-cost-per-hour",
        "prefill=3,decode=1.5",
    )
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def results(sweep: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((sweep / "results.json").read_text())
    return data


def test_schema_and_config(results: dict[str, Any]) -> None:
    assert results["schema"] == "pdserve.bench/1"
    assert results["traffic"]["workload"] == "long_mix"
    assert results["slo"]["ttft_ms"] == 3000.0
    assert [p["offered_rate"] for p in results["points"]] == list(RATES)
    for p in results["points"]:
        assert set(p["metrics"]) >= {
            "ttft_ms",
            "itl_ms",
            "tpot_ms",
            "e2e_ms",
            "goodput",
            "slo_attainment",
            "prefix_hit_ratio",
            "errors_by_code",
        }
        assert set(p["metrics"]["ttft_ms"]) == {"count", "mean", "p50", "p90", "p99"}


def test_counts_add_up(results: dict[str, Any]) -> None:
    for p in results["points"]:
        m, reqs = p["metrics"], p["requests"]
        assert m["sent"] == len(reqs) == NUM_REQUESTS  # 8 requests fit in 30 s at 2-4/s
        assert m["ok"] + m["errors"] == m["sent"]
        assert sum(m["errors_by_code"].values()) == m["errors"]
        assert m["ok"] == sum(r["code"] == "OK" for r in reqs) == m["sent"]
        kinds = m["by_kind"]
        assert kinds["long"]["sent"] == 2 and kinds["chat"]["sent"] == 6
        assert m["output_tokens"] == sum(r["output_tokens"] for r in reqs)
        assert m["ttft_ms"]["count"] == m["ok"]
        assert m["itl_ms"]["count"] == sum(len(r["token_gaps_s"]) for r in reqs)


def test_timestamps_monotonic(results: dict[str, Any]) -> None:
    for p in results["points"]:
        reqs = p["requests"]
        sent = [r["sent_s"] for r in reqs]
        assert sent == sorted(sent) and sent[0] >= 0
        for r in reqs:
            assert r["sent_s"] <= r["first_token_s"] <= r["finished_s"]
            assert all(g >= 0 for g in r["token_gaps_s"])
            # the first token comes from prefill; each later message carries tokens
            assert 1 <= len(r["token_gaps_s"]) + 1 <= r["output_tokens"]
            assert r["prefill_worker"] == "prefill-0"
        ttft = p["metrics"]["ttft_ms"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]


def test_rates_and_attainment_in_range(results: dict[str, Any]) -> None:
    for p in results["points"]:
        m = p["metrics"]
        for key in ("slo_attainment", "ttft_attainment", "itl_attainment", "prefix_hit_ratio"):
            assert 0.0 <= m[key] <= 1.0
        assert m["slo_attainment"] <= min(m["ttft_attainment"], m["itl_attainment"])
        assert 0 <= m["goodput"] <= m["request_throughput"]
        assert all(0.0 <= k["slo_attainment"] <= 1.0 for k in m["by_kind"].values())
        long_prompts = [r["prompt_tokens"] for r in p["requests"] if r["kind"] == "long"]
        assert min(long_prompts) >= 200
    # 4 system prompts shared by 16 chat requests on one prefill worker: some must hit
    assert sum(p["metrics"]["cached_tokens"] for p in results["points"]) > 0


def test_plots_and_summary(sweep: Path, results: dict[str, Any]) -> None:
    assert results["plots"] == {name: f"{name}.png" for name in PLOTS}
    for name in PLOTS:
        with Image.open(sweep / f"{name}.png") as img:
            img.verify()
    summary = (sweep / "summary.md").read_text()
    assert "| rate=2 |" in summary and "| rate=4 |" in summary


def test_cost_per_million_tokens_at_the_slo(sweep: Path, results: dict[str, Any]) -> None:
    """The workers counted from ClusterStatus at their role's price, and each point's
    cost divided by its output tokens per hour within the SLO."""
    assert results["cost"] == {"workers": {"prefill": 1, "decode": 1}, "per_hour": 4.5}
    summary = (sweep / "summary.md").read_text()
    assert "Cost: 1 decode, 1 prefill worker(s) at 4.5 per hour" in summary
    for p in results["points"]:
        m = p["metrics"]
        assert 0 < m["goodput_token_throughput"] <= m["output_token_throughput"]
        each = 4.5 / (m["goodput_token_throughput"] * 3600) * 1e6
        assert f"- {p['label']}: {each:.4g} per million output tokens at the SLO" in summary


def test_closed_loop_trace_replay(cluster: LocalCluster, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"prompt": "Name a colour.", "max_tokens": 3, "kind": "qa"},
        {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
        {"prompt_tokens": 40, "max_tokens": 2},
        {"prompt": "Count to three.", "max_tokens": 5, "kind": "qa"},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rc = _bench(
        cluster,
        tmp_path / "out",
        "--workload",
        "trace",
        "--trace-path",
        str(trace),
        "--arrival",
        "closed",
        "--concurrency",
        "2",
        "--num-requests",
        "4",
    )
    assert rc == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    (point,) = data["points"]
    assert point["arrival"] == "closed" and point["concurrency"] == 2
    m = point["metrics"]
    assert m["sent"] == m["ok"] == 4 and m["by_kind"]["qa"]["sent"] == 2
    assert sorted(r["output_tokens"] for r in point["requests"]) == [2, 3, 4, 5]


def test_workers_run_on_one_core_each(cluster: LocalCluster) -> None:
    cores = sorted(os.sched_getaffinity(0))
    workers = {c.name: c.proc.pid for c in cluster.children if c.name != "gateway"}
    for slot, name in enumerate(("prefill-0", "decode-0")):
        pid = workers[name]
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert tids
        for tid in tids:
            assert os.sched_getaffinity(tid) == {cores[slot % len(cores)]}, (name, tid)
