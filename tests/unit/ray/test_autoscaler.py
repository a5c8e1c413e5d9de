"""The autoscaler's decisions (growth on any signal over target, shrinking only after
every signal stayed low for the window, cool-downs, limits), the histogram quantile it
reads latencies with, and one loop round against a stand-in reader and scaler."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

import pytest

from services.common.config import add_config_args, config_from_args
from services.ray.autoscaler import (
    ITL,
    TTFT,
    AutoscaleConfig,
    AutoscaleLoop,
    Autoscaler,
    PoolName,
    PoolSignals,
    SignalReader,
    Why,
    bucket_quantile,
    histogram,
)
from services.ray.config import RayConfig

P, D = PoolName.PREFILL, PoolName.DECODE
CFG = AutoscaleConfig(
    ttft_p90_s=1.0, queued_tokens_per_worker=1000, itl_p90_s=0.1, kv_utilization=0.8,
    down_fraction=0.5, down_window_s=30, up_cooldown_s=10, down_cooldown_s=60,
    max_prefill=3, max_decode=3,
)  # fmt: skip


def test_each_pool_grows_on_its_own_signals() -> None:
    a = Autoscaler(CFG)
    assert a.decide(P, PoolSignals(1, latency_p90_s=1.5), 0).why is Why.LATENCY
    assert a.decide(D, PoolSignals(1, latency_p90_s=0.2), 0).why is Why.LATENCY
    b = Autoscaler(CFG)
    grow = b.decide(P, PoolSignals(2, queued_prompt_tokens=2400), 0)  # 1200 per worker
    assert (grow.why, grow.target) == (Why.QUEUE, 3)
    kv = b.decide(D, PoolSignals(1, latency_p90_s=0.05, kv_utilization=0.9), 0)
    assert (kv.why, kv.target) == (Why.KV, 2)
    # A prefill signal does not move the decode pool, nor the other way round.
    c = Autoscaler(CFG)
    assert c.decide(D, PoolSignals(1, queued_prompt_tokens=10**6), 0).why is Why.HOLD


def test_growth_waits_out_the_cooldown_and_stops_at_the_max() -> None:
    a = Autoscaler(CFG)
    hot = PoolSignals(1, latency_p90_s=5.0)
    assert a.decide(P, hot, 0).target == 2
    assert a.decide(P, PoolSignals(2, latency_p90_s=5.0), 5).why is Why.COOLDOWN
    assert a.decide(P, PoolSignals(2, latency_p90_s=5.0), 10).target == 3
    assert a.decide(P, PoolSignals(3, latency_p90_s=5.0), 100).why is Why.AT_LIMIT


def test_shrinking_needs_every_signal_low_for_the_whole_window() -> None:
    a = Autoscaler(CFG)
    low = PoolSignals(2, latency_p90_s=0.2, queued_prompt_tokens=100)
    mid = PoolSignals(2, latency_p90_s=0.7)  # under target, over the low mark: hysteresis
    assert a.decide(P, low, 100).why is Why.HOLD
    assert a.decide(P, mid, 120).why is Why.HOLD  # the window starts again
    assert a.decide(P, low, 125).why is Why.HOLD
    assert a.decide(P, low, 150).why is Why.HOLD  # 25 s low
    shrink = a.decide(P, low, 155)
    assert (shrink.why, shrink.target) == (Why.IDLE, 1)
    # At the min it stays; an idle pool with no samples counts as low.
    assert a.decide(P, PoolSignals(1), 1000).why is Why.HOLD
    assert a.decide(P, PoolSignals(1), 1031).why is Why.AT_LIMIT


def test_a_shrink_waits_out_the_down_cooldown_after_a_growth() -> None:
    a = Autoscaler(CFG)
    assert a.decide(D, PoolSignals(1, kv_utilization=0.95), 0).target == 2
    idle = PoolSignals(2, latency_p90_s=0.01, kv_utilization=0.1)
    assert a.decide(D, idle, 1).why is Why.HOLD
    assert a.decide(D, idle, 40).why is Why.COOLDOWN  # low for 39 s, 40 s after a change
    assert a.decide(D, idle, 61).target == 1


def test_bucket_quantile_interpolates_like_promql() -> None:
    buckets = [(0.1, 10.0), (0.5, 50.0), (1.0, 90.0), (math.inf, 100.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (40 / 40))
    assert bucket_quantile(0.9, buckets) == pytest.approx(1.0)
    assert bucket_quantile(0.95, buckets) == pytest.approx(1.0)  # in +Inf: the last bound
    assert bucket_quantile(0.05, buckets) == pytest.approx(0.05)
    assert bucket_quantile(0.9, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_histogram_sums_label_sets_of_a_scraped_page() -> None:
    page = {
        f"{TTFT}_bucket{{le=0.5}}": 3.0,
        f"{TTFT}_bucket{{le=+Inf}}": 4.0,
        f"{TTFT}_bucket{{gateway=b,le=0.5}}": 1.0,
        f"{TTFT}_count": 4.0,
        f"{ITL}_bucket{{le=0.5}}": 7.0,
    }
    assert histogram(page, TTFT) == {0.5: 4.0, math.inf: 4.0}


class _Board:
    def read(self, roles: object) -> list[object]:
        return []


def _page(ttft_slow: int, itl_fast: int) -> Mapping[str, float]:
    return {
        f"{TTFT}_bucket{{le=0.5}}": 0.0, f"{TTFT}_bucket{{le=5.0}}": float(ttft_slow),
        f"{TTFT}_bucket{{le=+Inf}}": float(ttft_slow),
        f"{ITL}_bucket{{le=0.05}}": float(itl_fast), f"{ITL}_bucket{{le=+Inf}}": float(itl_fast),
    }  # fmt: skip


def test_a_loop_round_scales_from_the_latency_of_the_last_interval() -> None:
    pages = [_page(10, 50), _page(10, 90)]  # no new TTFT samples in the second interval
    reader = SignalReader(_Board(), lambda: pages.pop(0))  # type: ignore[arg-type]
    sizes = {P: 1, D: 1}
    scaled: list[tuple[PoolName, int]] = []

    def scale(pool: PoolName, n: int) -> None:
        scaled.append((pool, n))
        sizes[pool] = n

    loop = AutoscaleLoop(CFG, reader, lambda: dict(sizes), scale)
    first = {d.pool: d for d in loop.tick(now=0.0)}
    assert first[P].why is Why.LATENCY and first[D].why is Why.HOLD
    assert scaled == [(P, 2)] and loop.changes == 1
    second = {d.pool: d for d in loop.tick(now=20.0)}
    assert second[P].why is Why.HOLD  # TTFT samples were all in the first interval
    assert loop.status()["pools"] == {
        "prefill": {"size": 2, "target": 2, "why": "hold"},
        "decode": {"size": 1, "target": 1, "why": "hold"},
    }


def test_ray_flags_hold_the_autoscaler_to_the_slo_flags() -> None:
    cfg = RayConfig(autoscale=True, autoscale_max_decode=6).autoscale_config(2.0, 0.2)
    assert (cfg.ttft_p90_s, cfg.itl_p90_s, cfg.max_decode) == (2.0, 0.2, 6)
    with pytest.raises(ValueError, match="min_prefill <= max_prefill"):
        RayConfig(autoscale_max_prefill=0)


def test_autoscale_is_a_bare_flag() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, RayConfig, env={})
    assert config_from_args(RayConfig, parser.parse_args(["--autoscale"])).autoscale
    off = parser.parse_args(["--autoscale", "false", "--num-routers", "2"])
    assert not config_from_args(RayConfig, off).autoscale
    assert not config_from_args(RayConfig, parser.parse_args([])).autoscale
