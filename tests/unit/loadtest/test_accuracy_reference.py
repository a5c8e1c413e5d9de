"""The accuracy gate's yardsticks: reference implementations of each mode scored against
transformers' own fp32, and each mode's free-running agreement held to its yardstick's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.precision import KvCacheDType
from loadtest.engine import accuracy, accuracy_reference
from loadtest.engine.accuracy import continuations
from loadtest.engine.accuracy_reference import (
    YARDSTICKS,
    Reference,
    ReferenceScores,
    Scored,
    Yardstick,
)
from loadtest.reports.engine_sections import accuracy as render
from tests.conftest import EngineFactory

pytest.importorskip("transformers")

BF16_YARD, KV_INT8_YARD = YARDSTICKS[0], YARDSTICKS[3]


def test_reference_float32_continues_as_the_engine_does(
    model_dir: Path, make_engine: EngineFactory
) -> None:
    engine = make_engine()
    prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "1, 2, 3,")]
    text = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    n = 6
    ours = continuations(engine, prompts)  # CONTINUATION_TOKENS each, EOS ignored
    measured = accuracy_reference.measure(model_dir, text, prompts, n, [BF16_YARD, KV_INT8_YARD])
    # transformers in fp32 is what the parity tests hold the fp32 engine to.
    assert measured.float32.continuations == [c[:n] for c in ours]
    assert [s.yardstick for s in measured.scored] == [BF16_YARD, KV_INT8_YARD]
    assert 1 < measured.float32.perplexity < 1e3
    for s in measured.scored:
        assert all(len(c) == n for c in s.scores.continuations)
        # The reduced formats move perplexity a little, never by half...
        assert s.scores.perplexity == pytest.approx(measured.float32.perplexity, rel=0.5)
        # ...and rank fp32's own greedy tokens first nearly everywhere (a model in the
        # wrong dtype, or misaligned positions, would not).
        assert s.forced_agreement >= 0.75
    # The 8-bit cache is really in the path: its perplexity is not float32's.
    assert measured.scored[1].scores.perplexity != measured.float32.perplexity


def test_a_missing_library_leaves_its_yardstick_unmeasured(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = accuracy_reference.importlib.util.find_spec
    monkeypatch.setattr(
        accuracy_reference.importlib.util, "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real(name, *a),
    )  # fmt: skip
    int8 = YARDSTICKS[1]
    assert int8.int8_weights
    measured = accuracy_reference.measure(model_dir, [1, 2, 3, 4], [[1, 2]], 2, [int8])
    assert measured.scored == []
    assert "bitsandbytes is not installed" in measured.unavailable[int8.name]


@pytest.mark.parametrize("kv", [KvCacheDType.INT8, KvCacheDType.FP8_E4M3])
def test_the_8bit_cache_rounds_each_token_and_head_to_its_own_scale(kv: KvCacheDType) -> None:
    x = torch.randn(1, 3, 5, 64) * torch.tensor([1.0, 10.0, 1000.0]).view(1, 3, 1, 1)
    got = accuracy_reference._fake_quantize(x, kv)
    scale = x.abs().amax(-1, keepdim=True) / (127 if kv is KvCacheDType.INT8 else 448)
    err = (got - x).abs() / scale  # in units of each (token, head)'s own step
    assert got.dtype == x.dtype and not torch.equal(got, x)
    if kv is KvCacheDType.INT8:
        assert float(err.max()) <= 0.5 + 1e-4  # round to nearest
        assert len(torch.unique(got[0, 0, 0] / scale[0, 0, 0])) <= 255
    else:
        # e4m3 keeps 3 mantissa bits: relative error at most 2**-4 above its normals.
        big = x.abs() > 2**-6 * 448 * scale
        assert float(((got - x).abs() / x.abs())[big].max()) <= 2**-4 + 1e-6


def test_yardstick_rows_are_scored_as_their_modes_gate_would() -> None:
    fp32 = ReferenceScores(10.0, [[1, 2, 3, 4], [5, 6, 7, 8]])
    bf16 = Scored(BF16_YARD, ReferenceScores(10.05, [[1, 2, 9, 9], [5, 6, 7, 8]]), 0.95)
    kv = Scored(KV_INT8_YARD, ReferenceScores(10.3, [[1, 2, 3, 4], [5, 6, 7, 8]]), 0.99)
    rows = accuracy.reference_rows(Reference(fp32, [bf16, kv]), accuracy.MODES)
    assert [r.name for r in rows] == [BF16_YARD.name, KV_INT8_YARD.name]
    assert rows[0].ppl_rise == pytest.approx(0.005)
    assert rows[0].max_ppl_rise == accuracy.BF16.max_ppl_rise
    assert rows[0].agreement == pytest.approx((2 / 4 + 1) / 2)
    assert rows[0].prefix_agreement == pytest.approx((2 / 4 + 1) / 2)
    assert rows[0].passed  # teacher-forced 0.95 >= 0.90 and +0.5% <= +1%
    assert not rows[1].passed and rows[1].max_ppl_rise == 0.02  # +3% over kv int8's +2%


def test_free_running_floor_rejects_a_broken_mode_and_keeps_a_noisy_one() -> None:
    yard = [1.0, 0.25, 0.5, 1.0, 0.0625, 1.0, 0.75, 0.375] * 3  # 24 prompts, mean ~0.62
    floor = accuracy.free_running_floor(yard, yard)
    assert 0.3 < floor < 0.62  # the same distribution passes, with room for noise
    noisy = yard[1:] + yard[:1]
    assert sum(noisy) / len(noisy) >= accuracy.free_running_floor(noisy, yard)
    broken = [0.0625, 0.0, 0.125, 0.0] * 6  # leaves float32 at the first token or two
    assert sum(broken) / len(broken) < accuracy.free_running_floor(broken, yard)


def test_a_mode_is_held_to_its_yardstick() -> None:
    ref32 = [[1, 2, 3, 4]] * 4
    report = accuracy.AccuracyReport(modes=[
        accuracy.ModeResult("bfloat16", "bfloat16", "none", 10.0, passed=True),
        accuracy.ModeResult("kv int8", "float32", "none", 10.0, passed=True),
    ])  # fmt: skip
    yard = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4]]
    measured = Reference(
        ReferenceScores(10.0, ref32),
        [Scored(BF16_YARD, ReferenceScores(10.0, yard), 1.0),
         Scored(KV_INT8_YARD, ReferenceScores(10.0, yard), 1.0)],
    )  # fmt: skip
    own = {"bfloat16": yard, "kv int8": [[9, 9, 9, 9]] * 4}
    accuracy.hold_to_yardsticks(report, measured, ref32, own)
    bf16, kv = report.modes
    assert bf16.yardstick == BF16_YARD.name and bf16.yardstick_agreement == pytest.approx(15 / 16)
    assert bf16.passed and bf16.free_floor is not None and bf16.free_floor < 15 / 16
    assert not kv.passed  # agrees nowhere against a yardstick near 1


def test_page_shows_the_yardsticks_beside_the_gate() -> None:
    fp32 = ReferenceScores(10.0, [[1, 2]])
    rows = accuracy.reference_rows(
        Reference(fp32, [Scored(BF16_YARD, ReferenceScores(10.0, [[1, 3]]), 1.0)]),
        accuracy.MODES,
    )
    mode = accuracy.ModeResult("bfloat16", "bfloat16", "none", 10.0, agreement=0.6,
                               yardstick_agreement=0.7, free_floor=0.45)  # fmt: skip
    data = {
        "modes": [vars(mode)], "reference": [vars(r) for r in rows],
        "reference_fp32_same": 19, "prompts": 20,
        "unavailable": {"bitsandbytes LLM.int8(), float32": "bitsandbytes is not installed"},
    }  # fmt: skip
    text = "\n".join(render(data))
    assert BF16_YARD.name in text
    assert "on 19 of 20 prompts" in text
    assert "| 0.500 |" in text  # the yardstick's free-running agreement
    assert "| 0.700 | >= 0.450 |" in text  # the mode's yardstick and floor
    assert "Not measured: bitsandbytes LLM.int8(), float32" in text
    assert "yardsticks, same run" not in "\n".join(render({"modes": []}))


def test_the_gated_report_is_handed_out_before_the_yardstick_runs(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m loadtest.engine.accuracy` writes the gated modes' results before transformers
    is scored, so a failure there loses nothing measured before it. Engines faked."""

    def score(config: object, prompts: object, ref: object = None, free_running: bool = True):  # type: ignore[no-untyped-def]
        return accuracy._Scores([[1, 2]], 10.0, [[3, 4]], [5, 6], model_dir, forced_agreement=1.0)

    def broken(*args: object) -> Reference:
        raise RuntimeError("transformers could not load")

    monkeypatch.setattr(accuracy, "_score", score)
    monkeypatch.setattr(accuracy_reference, "measure", broken)
    handed: list[accuracy.AccuracyReport] = []
    base = accuracy.EngineConfig(model=str(model_dir))
    with pytest.raises(RuntimeError, match="could not load"):
        accuracy.measure(base, [accuracy.BF16], reference=True, gated=handed.append)
    assert [[m.name for m in r.modes] for r in handed] == [["float32", "bfloat16"]]
    assert handed[0].modes[1].passed and not handed[0].reference


def test_yardsticks_cover_every_gated_mode() -> None:
    assert sorted(y.gated for y in YARDSTICKS) == sorted(m.name for m in accuracy.MODES)
    assert all(isinstance(y, Yardstick) for y in YARDSTICKS)
