"""Capacity from worker signals: the start-delay estimate by class, the requests this
gateway admitted before the workers saw them, and the decode pool's room."""

from __future__ import annotations

import pytest

from engine.priority import Priority
from engine.stats import ClassCounts
from services.common.role import Role
from services.gateway.flow.capacity import Capacity, Cost
from services.gateway.flow.prefill_site import SitePolicy
from services.router.worker_signal import WorkerSignal

NONE_WAITING = ClassCounts()
CRIT, STD, SHED = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def signal(role: Role, *, waiting: ClassCounts = NONE_WAITING, rate: float = 0.0,
           free: int = 100, age: float = 0.0, wid: str = "") -> WorkerSignal:  # fmt: skip
    return WorkerSignal(
        worker_id=wid or f"{role}-{rate}-{free}", role=role, waiting_tokens=waiting,
        waiting=0, running=0, free_blocks=free, total_blocks=1000, block_size=16,
        prefill_tokens_per_s=rate, decode_step_s=0.02, age_s=age,
    )  # fmt: skip


def test_no_measured_speed_means_no_estimate() -> None:
    cap = Capacity()
    cap.update([signal(Role.PREFILL), signal(Role.DECODE)])
    assert cap.estimate(Cost(100, 10), STD) is None and cap.start_delay_s(Cost(100, 10), STD) == 0.0


def test_delay_counts_only_classes_at_or_above() -> None:
    cap = Capacity()
    queued = ClassCounts(sheddable=4000, standard=1000, critical=200)
    cap.update([signal(Role.PREFILL, waiting=queued, rate=500.0, wid="p1"),
                signal(Role.PREFILL, rate=500.0, wid="p2"), signal(Role.DECODE)])  # fmt: skip
    assert cap.start_delay_s(Cost(100, 10), CRIT) == pytest.approx(0.3)
    assert cap.start_delay_s(Cost(100, 10), STD) == pytest.approx(1.3)
    assert cap.start_delay_s(Cost(100, 10), SHED) == pytest.approx(5.3)


def test_admitted_requests_count_until_the_workers_report_them() -> None:
    cap = Capacity()
    cap.update([signal(Role.PREFILL, rate=1000.0, age=0.5), signal(Role.DECODE)], now=10.0)
    before = cap.start_delay_s(Cost(100, 10), STD)
    admitted = cap.admitted(Cost(400, 10), STD)
    assert cap.start_delay_s(Cost(100, 10), STD) == pytest.approx(before + 0.4)
    assert cap.start_delay_s(Cost(100, 10), CRIT) == pytest.approx(before)  # lower class
    assert cap.pending == 1
    admitted.settled = True
    cap.update([signal(Role.PREFILL, rate=1000.0), signal(Role.DECODE)])
    assert cap.pending == 0


def test_decode_room_includes_pending_passes() -> None:
    cap = Capacity()
    cap.update([signal(Role.PREFILL, rate=1.0), signal(Role.DECODE, free=20)])
    assert cap.decode_fits(Cost(16 * 10, 16 * 10))  # 20 blocks exactly
    assert not cap.decode_fits(Cost(16 * 10, 16 * 11))
    cap.admitted(Cost(16 * 5, 16 * 5), STD)  # 10 blocks on their way
    assert not cap.decode_fits(Cost(16 * 10, 16 * 10)) and cap.decode_fits(Cost(16 * 5, 16 * 5))


def test_mixed_workers_stand_in_for_both_pools() -> None:
    cap = Capacity()
    cap.update([signal(Role.MIXED, rate=200.0, free=50)])
    assert cap.estimate(Cost(200, 1), STD) is not None and cap.start_delay_s(
        Cost(200, 1), STD
    ) == pytest.approx(1.0)
    assert cap.decode_fits(Cost(16 * 50, 0)) and not cap.decode_fits(Cost(16 * 51, 0))


def test_higher_classes_arriving_lately_slow_a_lower_one() -> None:
    cap = Capacity()
    cap.update([signal(Role.PREFILL, rate=1000.0), signal(Role.DECODE)])
    alone = cap.start_delay_s(Cost(100, 10), STD)
    assert alone == pytest.approx(0.1)
    cap.admitted(Cost(2000, 10), CRIT)  # 2000 critical tokens in the last 5 s: 400/s
    assert cap.start_delay_s(Cost(100, 10), STD) == pytest.approx((2000 + 100) / 600)
    assert cap.start_delay_s(Cost(100, 10), CRIT) == pytest.approx((2000 + 100) / 1000)


def test_a_prompt_sent_before_the_signal_is_the_workers_to_count() -> None:
    cap = Capacity()
    admitted = cap.admitted(Cost(500, 10), SHED)
    admitted.sent = 5.0
    cap.update([signal(Role.PREFILL, rate=1000.0, age=1.0), signal(Role.DECODE)], now=7.0)
    assert cap.start_delay_s(Cost(100, 10), SHED) == pytest.approx(0.1)  # taken at 6.0
    admitted.sent = 6.5
    assert cap.start_delay_s(Cost(100, 10), SHED) == pytest.approx(0.6)


def test_calibration_learns_how_late_first_tokens_come() -> None:
    cap = Capacity()
    cap.update([signal(Role.PREFILL, rate=1000.0), signal(Role.DECODE)])
    assert cap.start_delay_s(Cost(500, 10), STD) == pytest.approx(0.5)
    for _ in range(30):  # every first token comes twice as late as estimated
        admitted = cap.admitted(Cost(500, 10), STD)
        admitted.sent = admitted.admitted
        admitted.first_token = admitted.admitted + 2 * admitted.estimate_s
        admitted.settled = True
        cap.update([signal(Role.PREFILL, rate=1000.0), signal(Role.DECODE)])
    assert cap.calibration.factor == pytest.approx(2.0, rel=0.02)
    assert cap.start_delay_s(Cost(500, 10), CRIT) == pytest.approx(1.0, rel=0.02)
    assert cap.idle_delay_s(Cost(500, 10)) == pytest.approx(1.0, rel=0.02)


def test_a_request_larger_than_any_decode_pool_is_let_through() -> None:
    # Waiting could never make room: the worker refuses it at once (a 400 naming the pool)
    # instead of the request sitting out its budget in the waiting room.
    cap = Capacity()
    cap.update([signal(Role.PREFILL, rate=1.0), signal(Role.DECODE, free=20)])
    assert not cap.decode_fits(Cost(16 * 500, 16 * 500))  # 1,000 blocks: the whole pool
    assert cap.decode_fits(Cost(16 * 500, 16 * 501))  # more than the pool holds


def test_a_request_larger_than_any_prefill_pool_never_fits() -> None:
    # A prompt the prefill workers can never hold is let through at once rather than held
    # in the waiting room behind a busy prefill queue until the client's deadline.
    cap = Capacity()
    small = WorkerSignal(
        worker_id="p-small", role=Role.PREFILL, waiting_tokens=NONE_WAITING, waiting=0,
        running=0, free_blocks=10, total_blocks=100, block_size=16,
        prefill_tokens_per_s=100.0, decode_step_s=0.02, age_s=0.0,
    )  # fmt: skip
    cap.update([small, signal(Role.DECODE)])
    assert not cap.never_fits(Cost(16 * 50, 16 * 50))  # 100 blocks: the whole prefill pool
    assert cap.never_fits(Cost(16 * 50, 16 * 51))
    assert cap.never_fits(Cost(16 * 600, 16 * 600))  # past the decode pool too
    assert not Capacity().never_fits(Cost(10**6, 0))  # no signals: nothing is known


def test_a_prompt_that_may_stay_local_waits_on_the_sooner_pool() -> None:
    """Conditional disaggregation (local limit 512, busy rule at 1 s), placed as
    `SitePolicy` places it: a chat prompt is estimated on the decode pool too and is
    not held back by long prompts queued on the prefill pool; a prompt of up to 4x the
    limit may stay local only while the prefill pool is busy; a longer one waits on the
    prefill pool alone."""
    long_queue = ClassCounts(standard=8000)  # two 4k-token prompts: 8 s at 1,000 tok/s
    chat_queue = ClassCounts(standard=300)
    signals = [signal(Role.PREFILL, waiting=long_queue, rate=1000.0, wid="p"),
               signal(Role.DECODE, waiting=chat_queue, rate=600.0, wid="d")]  # fmt: skip
    cap = Capacity(SitePolicy(512, busy_s=1.0))
    cap.update(signals)
    assert cap.start_delay_s(Cost(300, 10), STD) == pytest.approx(1.0)  # (300 + 300) / 600
    assert cap.idle_delay_s(Cost(300, 10), STD) == pytest.approx(0.5)  # on the same pool
    assert cap.start_delay_s(Cost(1000, 10), STD) == pytest.approx(1300 / 600)  # busy rule
    assert cap.start_delay_s(Cost(4000, 10), STD) == pytest.approx(12.0)  # prefill pool
    # A long prompt admitted before the signals show it counts on the prefill pool only.
    cap.admitted(Cost(4000, 10), STD)
    assert cap.start_delay_s(Cost(300, 10), STD) == pytest.approx(1.0)
    cap.admitted(Cost(300, 10), STD)  # a chat prompt may have gone either way: both
    assert cap.start_delay_s(Cost(300, 10), STD) == pytest.approx(1.5)
    # Without the busy rule a short prompt always stays local and a longer one never.
    no_busy = Capacity(SitePolicy(512, busy_s=0.0))
    no_busy.update(signals)
    assert no_busy.start_delay_s(Cost(300, 10), STD) == pytest.approx(1.0)
    assert no_busy.start_delay_s(Cost(1000, 10), STD) == pytest.approx(9.0)
    hop_only = Capacity()
    hop_only.update(signals)
    assert hop_only.start_delay_s(Cost(300, 10), STD) == pytest.approx(8.3)


def test_an_estimate_needs_a_measured_pool_that_may_prefill_the_request() -> None:
    """Decode workers often measure first (they prefill the chat prompts): a long
    prompt has no estimate until the prefill pool has one (admission then lets a few in
    at a time), and a short one without the busy rule none until the decode pool has."""
    decode_only = Capacity(SitePolicy(512, busy_s=0.0))
    decode_only.update([signal(Role.PREFILL, wid="p"), signal(Role.DECODE, rate=600.0, wid="d")])
    assert (
        decode_only.estimate(Cost(300, 10), STD) is not None
        and decode_only.estimate(Cost(4000, 10), STD) is None
    )
    assert decode_only.start_delay_s(Cost(4000, 10), STD) == 0.0
    prefill_only = Capacity(SitePolicy(512, busy_s=0.0))
    prefill_only.update([signal(Role.PREFILL, rate=1000.0, wid="p"), signal(Role.DECODE, wid="d")])
    assert (
        prefill_only.estimate(Cost(4000, 10), STD) is not None
        and prefill_only.estimate(Cost(300, 10), STD) is None
    )


def test_with_local_prefill_the_decode_pool_holds_what_the_prefill_pool_cannot() -> None:
    small = WorkerSignal(
        worker_id="p-small", role=Role.PREFILL, waiting_tokens=NONE_WAITING, waiting=0,
        running=0, free_blocks=10, total_blocks=100, block_size=16,
        prefill_tokens_per_s=100.0, decode_step_s=0.02, age_s=0.0,
    )  # fmt: skip
    local = Capacity(SitePolicy(512, busy_s=0.0))
    local.update([small, signal(Role.DECODE)])  # 1,000 blocks
    assert not local.never_fits(Cost(16 * 50, 16 * 51))  # past the prefill pool only
    assert local.never_fits(Cost(16 * 600, 16 * 600))


def test_estimate_is_the_delays_in_one_pass() -> None:
    cap = Capacity()
    assert cap.estimate(Cost(500, 10), STD) is None  # no signals: no estimate
    queued = ClassCounts(standard=1000)
    cap.update([signal(Role.PREFILL, waiting=queued, rate=1000.0), signal(Role.DECODE)])
    found = cap.estimate(Cost(500, 10), STD)
    assert found is not None
    assert (found.start_delay_s, found.idle_delay_s) == pytest.approx((1.5, 0.5))
