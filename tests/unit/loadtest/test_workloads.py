"""Workload generation: the Zipf sampler, length draws, the long-prompt mix, the configs."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loadtest.harness.bench_config import BenchConfig, is_loopback
from loadtest.harness.runner import Pace, arrival_offsets
from loadtest.harness.traffic import TrafficConfig, draw_length, is_long, make_requests, parse_range
from loadtest.workloads.prefix import ZipfSampler
from loadtest.workloads.prompt_text import TextSynth

WORDS = [f" w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}x" for i in range(200)]


@pytest.fixture
def synth() -> TextSynth:
    return TextSynth(WORDS)


def test_zipf_probabilities() -> None:
    z = ZipfSampler(10, 1.1)
    probs = [z.probability(r) for r in range(10)]
    assert sum(probs) == pytest.approx(1.0)
    assert probs[0] / probs[1] == pytest.approx(2**1.1)
    assert probs == sorted(probs, reverse=True)


def test_zipf_sampler_frequencies_follow_the_law() -> None:
    z = ZipfSampler(8, 1.2)
    rng = random.Random(7)
    n = 40_000
    counts = Counter(z.sample(rng) for _ in range(n))
    assert set(counts) <= set(range(8))
    for rank in range(8):
        expected = n * z.probability(rank)
        # 5 standard deviations of a binomial count: fails only if the law is wrong
        assert abs(counts[rank] - expected) < 5 * (expected * (1 - expected / n)) ** 0.5
    with pytest.raises(ValueError):
        ZipfSampler(0, 1.0)


def test_parse_range_and_draws() -> None:
    assert parse_range("16-64") == (16, 64) and parse_range("7") == (7, 7)
    for bad in ("0-5", "9-3", "a-b", ""):
        with pytest.raises(ValueError):
            parse_range(bad)
    rng = random.Random(1)
    for dist in ("uniform", "loguniform"):
        draws = [draw_length(rng, (10, 1000), dist) for _ in range(2000)]
        assert min(draws) >= 10 and max(draws) <= 1000
    logs = [draw_length(rng, (10, 1000), "loguniform") for _ in range(4000)]
    # log-uniform: about half the draws below the geometric mean (100)
    assert 0.45 < sum(d < 100 for d in logs) / len(logs) < 0.55


def test_is_long_spreads_the_exact_fraction() -> None:
    flags = [is_long(i, 0.1) for i in range(100)]
    assert sum(flags) == 10
    assert [i for i, f in enumerate(flags) if f][:3] == [9, 19, 29]
    assert not any(is_long(i, 0.0) for i in range(50)) and all(is_long(i, 1.0) for i in range(50))


def test_long_mix_requests(synth: TextSynth) -> None:
    cfg = TrafficConfig(
        workload="long_mix",
        long_fraction=0.25,
        long_prompt_tokens="50-60",
        long_output_tokens="2-3",
        tenants=3,
        prompts_per_tenant=2,
    )
    reqs = make_requests(cfg, synth, 40, stream=1)
    kinds = Counter(r.kind for r in reqs)
    assert kinds == {"chat": 30, "long": 10}
    for r in reqs:
        if r.kind == "long":
            assert r.prompt is not None and 50 <= len(r.prompt.split()) <= 60
            assert 2 <= r.max_tokens <= 3
        else:
            assert r.messages is not None and [m[0] for m in r.messages] == ["system", "user"]
            assert 32 <= r.max_tokens <= 64 and r.tenant.startswith("tenant-")
    # system prompts are shared across streams; user text is not
    other = make_requests(cfg, synth, 40, stream=2)
    systems = {r.messages[0][1] for r in reqs + other if r.messages}
    assert len(systems) <= 6
    users = {r.messages[1][1] for r in reqs if r.messages}
    assert not users & {r.messages[1][1] for r in other if r.messages}
    assert make_requests(cfg, synth, 40, stream=1) == reqs  # deterministic


def test_synthetic_requests(synth: TextSynth) -> None:
    cfg = TrafficConfig(
        workload="synthetic",
        synthetic_prompt_tokens="5-9",
        synthetic_output_tokens="3",
        synthetic_dist="uniform",
    )
    reqs = make_requests(cfg, synth, 20)
    assert all(r.kind == "synthetic" and r.max_tokens == 3 for r in reqs)
    assert all(r.prompt is not None and 5 <= len(r.prompt.split()) <= 9 for r in reqs)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="workload"):
        TrafficConfig(workload="poetry")
    with pytest.raises(ValueError, match="trace_path"):
        TrafficConfig(workload="trace")
    with pytest.raises(ValueError, match="long_fraction"):
        TrafficConfig(long_fraction=1.5)
    with pytest.raises(ValueError, match="loopback"):
        BenchConfig(gateway="10.1.2.3:8470")
    assert BenchConfig(gateway="10.1.2.3:8470", allow_remote=True).gateway.startswith("10.")
    assert is_loopback("127.0.0.1:1") and is_loopback("localhost:1") and is_loopback("[::1]:1")
    cfg = BenchConfig(rates="0.5, 1,2")
    assert cfg.rate_list == [0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="rates"):
        BenchConfig(rates="0,1")
    with pytest.raises(ValueError):
        Pace("poisson", rate=0)


def test_poisson_offsets(synth: TextSynth) -> None:
    reqs = make_requests(TrafficConfig(), synth, 2000)
    offsets = arrival_offsets(reqs, rate=4.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    mean_gap = offsets[-1] / (len(offsets) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.1)
    assert arrival_offsets(reqs, rate=4.0, seed=3) == offsets


def test_text_synth_needs_words() -> None:
    with pytest.raises(ValueError):
        TextSynth(WORDS[:10])
    text = TextSynth(WORDS).text(random.Random(0), 12)
    assert len(text.split()) == 12 and not text.startswith(" ")
