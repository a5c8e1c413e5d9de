"""The router benchmark end to end in a tiny mode, plus its workload and simulation helpers.

One module-scoped run measures 200 decisions per pool shape against a real embedded
Redis and replays an 800-request workload through the real Router for every policy; the
tests check the JSON's schema, that its numbers are sane and add up (round trips counted,
hit ratios in [0, 1], nothing above the unlimited-cache upper bound, the load bound held,
every lease released), and that the Redis server is gone afterwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from loadtest.harness.settings import RunSettings
from loadtest.router import bench as router_bench
from loadtest.router import report as router_report
from loadtest.router.bench import parse_args
from loadtest.router.config import RouterBenchConfig
from loadtest.router.latency import RoundTripCounter
from loadtest.workloads.prefix import (
    ClusterSim,
    OraclePlacer,
    PrefixCache,
    SimConfig,
    WorkloadConfig,
    make_workload,
    run_policy,
    upper_bound_hit_ratio,
    zipf_weights,
)
from services.router.embedded_redis import EmbeddedRedis
from services.router.prefix_key import prefix_key, tenant_seed
from services.router.redis_client import connect
from services.router.router_config import POLICIES

DECISIONS = 200
WINDOW = 16
ARGV = [
    "--decisions", str(DECISIONS), "--latency-warmup", "20", "--requests", "800",
    "--warmup-requests", "200", "--tenants", "4", "--prompts-per-tenant", "3",
    "--window", str(WINDOW), "--replicas", "1,2",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "router.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = router_bench.main([*ARGV, "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def report(bench_run: tuple[dict[str, Any], str]) -> dict[str, Any]:
    return bench_run[0]


def test_schema_and_config(report: dict[str, Any]) -> None:
    assert report["schema"] == router_report.SCHEMA
    for key in ("provenance", "started_at", "finished_at", "wall_s", "redis_pid", "machine",
                "settings", "config", "workload", "latency", "hit_rate", "scale", "targets",
                "targets_met"):  # fmt: skip
        assert key in report
    assert report["started_at"] < report["finished_at"] and report["wall_s"] > 0
    assert report["config"]["decisions"] == DECISIONS
    assert report["workload"]["requests"] == 800
    assert report["workload"]["seed"] == report["settings"]["seed"] == 0
    assert report["provenance"]["host"]["cpu_count"] >= 1
    machine = report["machine"]
    assert len(machine["loadavg_start"]) == 3 and machine["redis_server"]


def test_latency_is_measured_against_ping(report: dict[str, Any]) -> None:
    assert [r["pool"] for r in report["latency"]] == ["mixed", "pd"]
    for r in report["latency"]:
        assert r["decisions"] == DECISIONS and r["fail_open"] == 0
        for side in ("route", "release", "ping"):
            p = r[side]
            assert 0 < p["p50_ms"] <= p["p99_ms"] <= p["max_ms"] and p["mean_ms"] > 0
        assert math.isclose(r["route_vs_ping_p50"], r["route"]["p50_ms"] / r["ping"]["p50_ms"])
        assert math.isclose(r["route_vs_ping_p99"], r["route"]["p99_ms"] / r["ping"]["p99_ms"])
        assert r["decisions_per_s"] > 0 and r["pings_per_s"] > 0


def test_round_trips_counted(report: dict[str, Any]) -> None:
    for r in report["latency"]:
        pools = len(r["workers"])
        # One pipelined round trip per route (a membership re-read adds two, at most once
        # a second), one per release whatever the pools.
        assert 1.0 <= r["round_trips_per_route"] <= 1.1
        assert r["round_trips_per_route_max"] in (1, 3)
        assert r["round_trips_per_release"] == 1.0
        # The server ran one placement script per pool per route, one release per pool per
        # decision (the registry read at a re-read is an EVALSHA too), and every PING.
        assert r["server_commands"]["ping"] == DECISIONS
        assert 2 * pools * DECISIONS <= r["server_commands"]["evalsha"] <= 2 * pools * DECISIONS + 3
        assert r["server_usec_per_evalsha"] > 0


def test_hit_rates_are_sane(report: dict[str, Any]) -> None:
    h = report["hit_rate"]
    assert [p["policy"] for p in h["policies"]] == list(POLICIES)
    assert h["oracle"]["policy"] == "oracle" and h["oracle_bounded"]["policy"] == "oracle_bounded"
    assert h["measured_requests"] == 600 and h["window"] == WINDOW
    assert h["capacity_blocks_per_worker"] * h["workers"] >= 1.5 * h["hot_blocks"]
    upper = h["upper_bound_hit_ratio"]
    everyone = [h["oracle"], h["oracle_bounded"], *h["policies"]]
    for p in everyone:
        assert 0.0 <= p["hit_ratio"] <= upper <= 1.0
        assert p["measured_requests"] == 600
        assert math.isclose(p["hit_ratio"], p["hit_tokens"] / p["prompt_tokens"])
        assert math.isclose(p["vs_oracle"], p["hit_ratio"] / h["oracle"]["hit_ratio"])
        assert 1.0 <= p["load_max_over_avg_mean"] <= p["load_max_over_avg_peak"] <= 8.0
    for p in h["policies"]:
        assert p["hit_ratio"] <= h["oracle"]["hit_ratio"] + 0.02  # a greedy oracle, not an optimum
        assert p["leases_left"] == 0 and p["fail_open"] == 0
        assert 0.0 <= p["overflow"] <= 1.0
    by_name = {p["policy"]: p for p in h["policies"]}
    assert by_name["consistent"]["hit_ratio"] > by_name["random"]["hit_ratio"]
    assert by_name["consistent"]["overflow"] == by_name["random"]["overflow"] == 0.0
    assert by_name["bounded"]["overflow"] > 0  # Zipf's head is above the bound
    tiered = h["tiered"]
    assert tiered["policy"] == f"{POLICIES[0]}+tier" and tiered["leases_left"] == 0
    assert h["tier_blocks_per_worker"] == 4 * h["capacity_blocks_per_worker"]
    # A tier only adds cache: at least the untiered run's hits, at most the upper bound.
    assert by_name[POLICIES[0]]["hit_ratio"] <= tiered["hit_ratio"] <= upper


def test_replicas_place_every_request_once_and_leave_nothing(report: dict[str, Any]) -> None:
    rows = report["scale"]
    assert [(r["design"], r["replicas"]) for r in rows] == [
        ("shared", 1), ("shared", 2), ("per_replica", 2)
    ]  # fmt: skip
    upper = report["hit_rate"]["upper_bound_hit_ratio"]
    for r in rows:
        assert r["decisions"] == 800 and r["leases_left"] == 0 and r["fail_open"] == 0
        # Each request: one placement and one release (membership re-reads add a few).
        assert 2.0 <= r["round_trips_per_request"] <= 2.1
        assert 0.0 < r["hit_ratio"] <= upper
        assert r["load_samples"] > 0
        assert 1.0 <= r["load_max_over_avg_mean"] <= r["load_max_over_avg_peak"] <= 8.0
        assert 0 < r["route"]["p50_ms"] <= r["route"]["p99_ms"]
    assert all(r["over_bound"] == 0 for r in rows if r["design"] == "shared")


def test_placement_by_reports_is_measured_beside_the_model_and_the_oracle(
    report: dict[str, Any],
) -> None:
    r = report["residency"]
    assert r["restarts"] == report["config"]["restarts"] > 0
    upper = report["hit_rate"]["upper_bound_hit_ratio"]
    for name in ("reported", "modelled", "oracle"):
        p = r[name]
        assert p["policy"] == name and p["leases_left"] == 0 and p["fail_open"] == 0
        assert 0.0 < p["hit_ratio"] <= upper
    assert r["reported"]["hit_ratio"] <= r["oracle"]["hit_ratio"] + 0.02
    assert math.isclose(r["reported_vs_modelled"],
                        r["reported"]["hit_ratio"] / r["modelled"]["hit_ratio"])  # fmt: skip
    assert 0 < r["run_blocks"] <= r["best_run_blocks"]


def test_load_bound_held(report: dict[str, Any]) -> None:
    eps, workers = report["config"]["eps"], report["config"]["workers"]
    cap = math.ceil((1 + eps) * WINDOW / workers) / (WINDOW / workers)
    bounded = next(p for p in report["hit_rate"]["policies"] if p["policy"] == "bounded")
    assert bounded["load_max_over_avg_peak"] <= cap
    assert report["hit_rate"]["oracle_bounded"]["load_max_over_avg_peak"] <= cap


def test_targets(report: dict[str, Any]) -> None:
    names = [t["name"] for t in report["targets"]]
    assert names == [
        "route p99 ms (mixed)", "round trips/route (mixed)",
        "route p99 ms (pd)", "round trips/route (pd)",
        "bounded hit ratio / oracle", "reported/modelled hit ratio",
        "reported hit ratio / bounded oracle", "placements over the bound, shared, 1-2 replicas",
        "hit ratio 2 replicas / 1, shared", "Redis round trips/request, 2 replicas",
    ]  # fmt: skip
    for t in report["targets"]:
        want = t["measured"] <= t["threshold"] if t["comparison"] == "<=" else (
            t["measured"] >= t["threshold"])  # fmt: skip
        assert t["met"] == want
    assert report["targets_met"] == all(t["met"] for t in report["targets"])


def test_redis_server_is_gone(report: dict[str, Any]) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(report["redis_pid"], 0)


def test_table_printed(bench_run: tuple[dict[str, Any], str]) -> None:
    report, table = bench_run
    assert "route/ping p50" in table and "/oracle" in table
    for r in report["latency"]:
        row = next(line for line in table.splitlines() if line.startswith(r["pool"] + " "))
        assert f"{r['route_vs_ping_p50']:.2f}x" in row
    for name in ("oracle", "oracle_bounded", *POLICIES):
        assert any(line.split()[:1] == [name] for line in table.splitlines())
    assert "all targets met" in table
    assert report["provenance"]["taken_at"] in table


# -- helpers --------------------------------------------------------------------------
def test_prefix_cache_is_lru_and_evicts_tails_first() -> None:
    cache = PrefixCache(4)
    cache.admit([1, 2, 3])
    assert cache.match([1, 2, 3, 9]) == 3 and cache.match([9, 1]) == 0
    cache.admit([7, 8])  # over capacity: the oldest entry goes, which is the tail 3
    assert len(cache) == 4 and cache.match([1, 2, 3]) == 2
    cache.admit([1])
    cache.admit([5, 6])  # evicts 2, then 8: each prefix loses its tail before its head
    assert len(cache) == 4
    assert cache.match([1, 2]) == 1 and cache.match([7, 8]) == 1 and cache.match([5, 6]) == 2


def test_prefix_cache_tier_keeps_what_the_pool_evicts() -> None:
    cache = PrefixCache(2, tier=2)
    cache.admit([1, 2])
    cache.admit([3, 4])  # 2 then 1 leave the pool for the tier
    assert cache.match([1, 2]) == 2 and len(cache) == 4
    cache.admit([1])  # back from the tier into the pool; 4 moves down
    cache.admit([5, 6])  # the tier is full: its least recent go
    assert cache.match([5, 6]) == 2 and len(cache) == 4
    assert cache.match([2]) == 0


def test_workload_is_seeded_zipf_and_keys_match_the_router() -> None:
    cfg = WorkloadConfig(tenants=3, prompts_per_tenant=2, requests=300, seed=7)
    wl = make_workload(cfg)
    assert wl == make_workload(cfg)
    assert len(wl.requests) == 300 and len(wl.system_blocks) == 6
    ranks = [r.rank for r in wl.requests]
    assert ranks.count(0) > ranks.count(5)
    w = zipf_weights(3, 1.1)
    assert w[0] == 1.0 and w[0] > w[1] > w[2]
    for r in wl.requests[:20]:
        assert len(r.block_hashes) == len(r.tokens) // cfg.block_size
        # The router's key is the 4th block's chained hash: a routing hit is a cache hit.
        key = prefix_key(r.tokens, cfg.block_size, 4, tenant_seed(cfg.model, r.tenant))
        assert key == r.block_hashes[3]


def test_oracles_against_the_upper_bound() -> None:
    wl = make_workload(WorkloadConfig(tenants=2, prompts_per_tenant=3, requests=400))
    cfg = SimConfig(workers=4, capacity_blocks=24, window=8, warmup=50)
    free = run_policy(wl, cfg, OraclePlacer())
    held = run_policy(wl, cfg, OraclePlacer(eps=0.25))
    upper = upper_bound_hit_ratio(wl, 50)
    assert 0 < held.hit_ratio <= free.hit_ratio <= upper <= 1
    assert held.load_max_over_avg_peak <= math.ceil(1.25 * 8 / 4) / 2
    assert free.policy == "oracle" and held.policy == "oracle_bounded"


def test_oracle_picks_the_longest_cached_prefix() -> None:
    wl = make_workload(WorkloadConfig(tenants=1, prompts_per_tenant=1, requests=2))
    sim = ClusterSim(SimConfig(workers=3, capacity_blocks=64, window=1, warmup=1))
    assert OraclePlacer().place(wl.requests[0], sim) == (0, ())  # all cold: lowest index
    sim.loads[0] = 5
    assert OraclePlacer().place(wl.requests[0], sim)[0] == 1  # all cold: least loaded
    sim.place(2, wl.requests[0])
    assert OraclePlacer().place(wl.requests[1], sim)[0] == 2  # same system prompt


def test_round_trip_counter_counts_a_pipeline_once() -> None:
    with EmbeddedRedis(tcp=True) as server:
        client = connect(server.url, timeout_s=2.0)
        counter = RoundTripCounter()
        counter.install(client)
        try:
            client.ping()
            after_connect = counter.count  # the handshake on connect counts too
            client.set("k", "v")
            pipe = client.pipeline(transaction=False)
            for _ in range(3):
                pipe.get("k")
            assert pipe.execute() == ["v"] * 3
            assert counter.count - after_connect == 2
        finally:
            client.close()


def test_config_from_flags(tmp_path: Path) -> None:
    settings, cfg = parse_args([*ARGV, "--policies", "bounded,random", "--system-tokens",
                                "32,64", "--pools", "pd", "--seed", "7", "--out",
                                str(tmp_path / "x.json")])  # fmt: skip
    assert cfg.policy_names == ("bounded", "random") and cfg.pool_shapes == ("pd",)
    workload = cfg.workload(settings.seed)
    assert workload.system_tokens == (32, 64) and workload.tenants == 4 and workload.seed == 7
    assert settings.out == tmp_path / "x.json"
    assert parse_args([]) == (RunSettings(out=Path("bench-results/router.json")),
                              RouterBenchConfig())  # fmt: skip
    assert RouterBenchConfig().workload(0) == WorkloadConfig()
    with pytest.raises(ValueError):
        RouterBenchConfig(policies="nope")
    with pytest.raises(ValueError):
        RouterBenchConfig(system_tokens="64")  # a range needs lo,hi
    with pytest.raises(ValueError):
        RouterBenchConfig(window=64, warmup_requests=10)  # statistics need a full window
    with pytest.raises(SystemExit):
        parse_args(["--pools", "ring"])  # a bad value is a usage error, not a traceback
