"""Predicting a decode worker's step time at a batch size, from curves the workers
publish; the curve a worker builds from its engine's counters; and the calibration of
the prediction by the gaps finished streams saw."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engine.stats import EngineStats
from services.gateway.flow.itl_calibration import ItlCalibration, ItlMeter
from services.gateway.flow.step_model import PRIOR_ROWS_PER_STEP, step_s_at
from services.worker.signal_publisher import DecodeCurve, EngineSpeeds

# A curve recorded from a decode worker of the development host (SmolLM2-135M, bf16):
# mean batch and seconds per step by batch bucket.
RECORDED = ((1.0, 0.0146), (2.0, 0.0165), (4.6, 0.0190), (8.0, 0.0250))


def test_within_the_measured_batches_the_curve_is_interpolated() -> None:
    assert step_s_at(RECORDED, 1) == pytest.approx(0.0146)
    assert step_s_at(RECORDED, 1.5) == pytest.approx((0.0146 + 0.0165) / 2)
    assert step_s_at(RECORDED, 8) == pytest.approx(0.0250)
    assert step_s_at(RECORDED, 0.5) == pytest.approx(0.0146)  # never faster than measured


def test_beyond_the_largest_batch_it_goes_on_along_its_last_slope() -> None:
    slope = (0.0250 - 0.0190) / (8.0 - 4.6)
    assert step_s_at(RECORDED, 16) == pytest.approx(0.0250 + 8 * slope)
    # Order does not matter, and unmeasured points (0) are ignored.
    assert step_s_at([(8.0, 0.025), (0.0, 0.0), *RECORDED[:3]], 16) == step_s_at(RECORDED, 16)


def test_one_point_or_a_falling_slope_extend_along_the_prior() -> None:
    (b, t) = (4.0, 0.024)
    prior = t * (PRIOR_ROWS_PER_STEP + 10) / (PRIOR_ROWS_PER_STEP + b)
    assert step_s_at([(b, t)], 10) == pytest.approx(prior)
    noisy = [(2.0, 0.026), (b, t)]  # the larger batch measured faster: noise
    assert step_s_at(noisy, 10) == pytest.approx(prior)


def test_nothing_measured_predicts_nothing() -> None:
    assert step_s_at((), 4) is None
    assert step_s_at([(0.0, 0.0)], 4) is None


IDLE = EngineStats(
    total_blocks=100, free_blocks=100, used_blocks=0, cached_blocks=0, held_blocks=0,
    importing_blocks=0, running=0, waiting=0, held_requests=0, importing_requests=0,
    prefix_hit_tokens=0, prefix_query_tokens=0, num_preemptions=0, kv_bytes_per_token=0,
    kv_pool_bytes=0, block_size=16,
)  # fmt: skip


def test_a_worker_builds_its_curve_from_its_counters() -> None:
    """Each interval's mean batch (tokens over steps) and mean step go to that batch's
    bucket; an interval without a decode adds nothing."""
    speeds = EngineSpeeds()
    totals = [(0, 0.0, 0)]
    # (steps, busy seconds, tokens) per interval: batch 1 at 15 ms, batch 8 at 25 ms,
    # a prefill-only interval, then batch 7 at 24 ms (the same bucket as 8).
    for steps, busy, tokens in ((10, 0.15, 10), (10, 0.25, 80), (0, 0.0, 0), (10, 0.24, 70)):
        last = totals[-1]
        totals.append((last[0] + steps, last[1] + busy, last[2] + tokens))
        s = dataclasses.replace(IDLE, decode_steps_total=totals[-1][0],
                                decode_busy_s_total=totals[-1][1],
                                decode_tokens_total=totals[-1][2])  # fmt: skip
        speeds.update(s)
    (b1, t1), (b8, t8) = speeds.curve.points(time.monotonic())
    assert (b1, t1) == pytest.approx((1.0, 0.015))
    assert 7.0 < b8 < 8.0 and 0.024 < t8 < 0.025
    assert step_s_at(speeds.curve.points(time.monotonic()), 4) is not None


def test_accepted_drafts_are_not_rows() -> None:
    """A step that verified drafts samples more tokens than it has rows: 4 streams whose
    steps each accepted 6 drafts in all sample 10 tokens, but the batch is 4."""
    speeds = EngineSpeeds()
    s = dataclasses.replace(IDLE, decode_steps_total=10, decode_busy_s_total=0.3,
                            decode_tokens_total=100, spec_accepted_total=60)  # fmt: skip
    speeds.update(s, now=0.0)
    ((batch, step_s),) = speeds.curve.points(0.0)
    assert (batch, step_s) == pytest.approx((4.0, 0.03))


def test_a_curve_forgets_a_batch_it_no_longer_runs() -> None:
    curve = DecodeCurve(max_age_s=60.0)
    curve.add(0.0, 0.01, 1.0, now=0.0)  # empty samples are ignored
    curve.add(3.0, 0.0, 1.0, now=0.0)
    assert curve.points(0.0) == ()
    curve.add(8.0, 0.09, 1.0, now=0.0)  # one slow interval at batch 8
    curve.add(1.0, 0.01, 1.0, now=50.0)
    assert [b for b, _ in curve.points(55.0)] == [1.0, 8.0]
    assert [b for b, _ in curve.points(61.0)] == [1.0]  # batch 8 unseen for over 60 s


def test_a_finished_streams_p90_gap_calibrates_the_prediction() -> None:
    calibration = ItlCalibration(alpha=0.5)
    meter = ItlMeter(calibration, predicted_s=0.040)
    meter.took(1, now=0.0)  # the first token: no gap yet
    for i in range(1, 20):  # 19 gaps of 40 ms, then one message of 2 tokens 240 ms later
        meter.took(1, now=0.04 * i)
    meter.took(2, now=0.04 * 19 + 0.24)
    assert len(meter.gaps) == 21 and meter.gaps[-1] == pytest.approx(0.12)
    meter.report()  # p90 of 19 x 40 ms and 2 x 120 ms: 40 ms (the 19th of 21)
    assert calibration.factor == pytest.approx(1.0)
    slow = ItlMeter(calibration, predicted_s=0.040)
    for i in range(12):
        slow.took(1, now=0.08 * i)  # every gap 80 ms: twice the prediction
    slow.report()
    assert calibration.factor == pytest.approx(1.5)  # half way to 2 (alpha 0.5)
    short = ItlMeter(calibration, predicted_s=0.040)
    for i in range(4):
        short.took(1, now=1.0 * i)  # 3 gaps: too few to say anything
    short.report()
    assert calibration.factor == pytest.approx(1.5)
