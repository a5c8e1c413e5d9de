"""The worker's load-signal publisher on a real embedded Redis, fed by a stats source the
test controls or by a tiny real engine: the signal appears within an interval and goes
when the publisher stops, the speeds are busy-time averages of the engine's counters,
and a dead Redis is logged once without stopping the publisher."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from pathlib import Path

import pytest
import redis

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.stats import ClassCounts, EngineStats
from services.common.role import Role
from services.router.keyspace import Keyspace
from services.router.redis_client import connect
from services.router.registry import Registry, WorkerInfo
from services.router.worker_signal import SignalBoard
from services.worker.calibration import (
    CALIBRATION_PROMPT_TOKENS,
    calibrate,
    calibration_prompt,
    prompt_room,
)
from services.worker.config import WorkerConfig
from services.worker.signal_publisher import BusyAverage, SignalPublisher, signal_ttl_s
from tests.conftest import assert_no_leaks
from tests.tiny_models import write_tiny_model

# Run alone (`make test`'s serial phase): a server restarted on the port it let go.
pytestmark = pytest.mark.serial

INTERVAL_S = 0.05
IDLE = EngineStats(
    total_blocks=100, free_blocks=60, used_blocks=40, cached_blocks=5, held_blocks=0,
    importing_blocks=0, running=2, waiting=3, held_requests=0, importing_requests=0,
    prefix_hit_tokens=0, prefix_query_tokens=0, num_preemptions=0, kv_bytes_per_token=64,
    kv_pool_bytes=6400, block_size=16,
    waiting_tokens_by_class=ClassCounts(sheddable=50, standard=40, critical=3),
)  # fmt: skip


class Stats:
    """A stats source whose snapshot the test sets."""

    def __init__(self) -> None:
        self.now = IDLE

    def __call__(self) -> EngineStats:
        return self.now


def registered_board(client: redis.Redis, namespace: str, worker_id: str) -> SignalBoard:
    keys = Keyspace(namespace)
    Registry(client, keys, ttl_s=30.0).register(
        WorkerInfo(worker_id, Role.PREFILL, "model-fp", "layout-fp", f"addr-{worker_id}")
    )
    return SignalBoard(client, keys, ttl_s=signal_ttl_s(INTERVAL_S))


async def _eventually_read(board: SignalBoard, want: bool, timeout_s: float = 5.0) -> list:
    """Poll the board until it has (or has not) a signal, up to a generous timeout."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = await asyncio.to_thread(board.read, [Role.PREFILL])
        if bool(found) == want or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(INTERVAL_S)


def test_the_signal_is_published_and_withdrawn(client: redis.Redis, namespace: str) -> None:
    board = registered_board(client, namespace, "p0")
    stats = Stats()

    async def scenario() -> None:
        publisher = SignalPublisher(board, stats, "p0", Role.PREFILL, INTERVAL_S).start()
        (got,) = await _eventually_read(board, want=True)
        assert (got.worker_id, got.role) == ("p0", Role.PREFILL)
        assert got.waiting_tokens == IDLE.waiting_tokens_by_class
        assert (got.waiting, got.running, got.free_blocks, got.total_blocks) == (3, 2, 60, 100)
        assert got.block_size == 16 and got.kv_utilisation == pytest.approx(0.4)
        assert got.prefill_tokens_per_s == got.decode_step_s == 0.0  # nothing measured yet
        stats.now = dataclasses.replace(IDLE, waiting=9)
        await asyncio.sleep(4 * INTERVAL_S)
        (later,) = await asyncio.to_thread(board.read, [Role.PREFILL])
        assert later.waiting == 9  # republished every interval
        await publisher.stop()
        assert await asyncio.to_thread(board.read, [Role.PREFILL]) == []
        await publisher.stop()  # a second stop is harmless

    asyncio.run(scenario())
    assert not client.exists(Keyspace(namespace).signal("p0"))


def test_a_real_engine_reports_its_measured_speeds(
    client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    write_tiny_model("qwen2", tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "tiny"), dtype="float32",
                                    num_kv_blocks=64, max_num_batched_tokens=32))  # fmt: skip
    board = registered_board(client, namespace, "p3")

    async def scenario() -> None:
        publisher = SignalPublisher(board, engine.stats, "p3", Role.PREFILL, INTERVAL_S)
        await publisher.publish_once()
        (idle,) = await asyncio.to_thread(board.read, [Role.PREFILL])
        assert idle.prefill_tokens_per_s == idle.decode_step_s == 0.0
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        await asyncio.to_thread(engine.generate, [list(range(1, 81))], params)
        await publisher.publish_once()
        (busy,) = await asyncio.to_thread(board.read, [Role.PREFILL])
        assert busy.prefill_tokens_per_s > 0 and busy.decode_step_s > 0
        assert busy.total_blocks == 64 and busy.free_blocks == 64  # cached blocks are free
        await publisher.stop()
        assert await asyncio.to_thread(board.read, [Role.PREFILL]) == []

    asyncio.run(scenario())
    assert_no_leaks(engine)


def _tiny_engine(tmp_path: Path, **kw: object) -> LLMEngine:
    write_tiny_model("qwen2", tmp_path / "tiny")
    cfg = EngineConfig(model=str(tmp_path / "tiny"), dtype="float32",  # type: ignore[arg-type]
                       max_num_batched_tokens=32, **kw)  # type: ignore[arg-type]  # fmt: skip
    return LLMEngine(cfg)


def test_a_calibrated_engine_signals_a_speed_from_its_first_publish(
    client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    """The worker calibrates before it registers: its first signal is never blind, and
    carries the measured prefill's speed, not the cold warm-up's."""
    engine = _tiny_engine(tmp_path, num_kv_blocks=64)
    calibration = calibrate(engine)
    assert calibration is not None and calibration.tokens_per_s > 0
    measured = min(CALIBRATION_PROMPT_TOKENS, prompt_room(engine))
    warm_up = calibration.baseline.prefill_tokens_total
    assert engine.stats().prefill_tokens_total == warm_up + measured
    board = registered_board(client, namespace, "p4")

    async def scenario() -> None:
        publisher = SignalPublisher(board, engine.stats, "p4", Role.PREFILL, INTERVAL_S)
        publisher.count_from(calibration.baseline)
        await publisher.publish_once()
        (first,) = await asyncio.to_thread(board.read, [Role.PREFILL])
        assert first.prefill_tokens_per_s == pytest.approx(calibration.tokens_per_s)
        assert first.free_blocks == 64  # the calibration's blocks are cached, so free
        await publisher.stop()

    asyncio.run(scenario())
    assert_no_leaks(engine)


def test_calibration_fits_a_small_pool_and_skips_an_engine_with_no_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    small = _tiny_engine(tmp_path, num_kv_blocks=4)  # 64 tokens: less than the prompt
    assert prompt_room(small) == 63
    assert calibrate(small) is not None
    assert_no_leaks(small)
    none = _tiny_engine(tmp_path, num_kv_blocks=4, max_model_len=1)
    with caplog.at_level(logging.WARNING):
        assert calibrate(none) is None  # the worker starts without it
    assert "no calibration" in caplog.text


def test_calibration_prompts_are_distinct_and_fit_any_vocabulary() -> None:
    warm, measured = calibration_prompt(49152, 16), calibration_prompt(49152, 128, 16)
    assert min(warm) >= 1000 and len(set(warm + measured)) == 16 + 128  # no shared block
    tiny = calibration_prompt(vocab_size=256, length=63)
    assert len(tiny) == 63 and max(tiny) < 256
    assert calibration_prompt(vocab_size=1, length=1) == [0]


def test_speeds_are_busy_time_averages_of_the_counters(client: redis.Redis, namespace: str) -> None:
    publisher = SignalPublisher(registered_board(client, namespace, "p1"), Stats(), "p1",
                                Role.MIXED, INTERVAL_S)  # fmt: skip
    s = dataclasses.replace(IDLE, prefill_tokens_total=1000, prefill_busy_s_total=0.5)
    assert publisher.signal(s).prefill_tokens_per_s == pytest.approx(2000.0)
    assert publisher.signal(s).prefill_tokens_per_s == pytest.approx(2000.0)  # idle: kept
    # A faster second interval moves the average by the weight of its busy time.
    s = dataclasses.replace(s, prefill_tokens_total=5000, prefill_busy_s_total=1.5)
    rate = publisher.signal(s).prefill_tokens_per_s
    assert 2000.0 < rate < 4000.0
    s = dataclasses.replace(s, decode_steps_total=10, decode_busy_s_total=0.2)
    got = publisher.signal(s)
    assert got.decode_step_s == pytest.approx(0.02) and got.prefill_tokens_per_s == rate


def test_busy_average_weights_by_busy_time() -> None:
    avg = BusyAverage(horizon_s=1.0)
    avg.add(100.0, busy_s=0.0)
    assert not avg.measured and avg.value == 0.0
    avg.add(100.0, busy_s=0.1)
    avg.add(200.0, busy_s=0.001)  # a sliver of work barely moves it
    assert 100.0 < avg.value < 100.2
    avg.add(200.0, busy_s=10.0)  # ten horizons of it: it is the new speed
    assert avg.value == pytest.approx(200.0, abs=0.01)


def test_a_dead_redis_is_logged_once_and_survived(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    board = SignalBoard(connect(f"redis://127.0.0.1:{port}", 0.2), Keyspace("dead"))

    async def scenario() -> None:
        publisher = SignalPublisher(board, Stats(), "p2", Role.PREFILL, INTERVAL_S).start()
        await asyncio.sleep(6 * INTERVAL_S)
        assert publisher._task is not None and not publisher._task.done()
        await publisher.stop()

    with caplog.at_level(logging.WARNING, logger="services.worker.signal_publisher"):
        asyncio.run(scenario())
    failed = [r for r in caplog.records if "not published" in r.getMessage()]
    assert len(failed) == 1
    assert any("could not withdraw" in r.getMessage() for r in caplog.records)


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="signal_interval_s"):
        WorkerConfig(signal_interval_s=0)
    assert WorkerConfig().signal_interval_s == 0.25
    assert signal_ttl_s(0.25) == 2.0 and signal_ttl_s(1.0) == 8.0
