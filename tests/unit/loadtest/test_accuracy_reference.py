"""The accuracy gate's yardstick: transformers' bf16 scored against its own fp32."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.engine import accuracy, accuracy_reference
from loadtest.engine.accuracy import continuations
from loadtest.engine.accuracy_reference import Reference, ReferenceScores
from loadtest.reports.engine_sections import accuracy as render
from tests.conftest import EngineFactory

pytest.importorskip("transformers")


def test_reference_float32_continues_as_the_engine_does(
    model_dir: Path, make_engine: EngineFactory
) -> None:
    engine = make_engine()
    prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "1, 2, 3,")]
    text = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    n = 6
    ours = continuations(engine, prompts)  # CONTINUATION_TOKENS each, EOS ignored
    measured = accuracy_reference.measure(model_dir, text, prompts, n)
    # transformers in fp32 is what the parity tests hold the fp32 engine to.
    assert measured.float32.continuations == [c[:n] for c in ours]
    assert all(len(c) == n for c in measured.bfloat16.continuations)
    assert 1 < measured.float32.perplexity < 1e3
    # bf16 moves perplexity a little, never by half.
    assert measured.bfloat16.perplexity == pytest.approx(measured.float32.perplexity, rel=0.5)
    # bf16 ranks fp32's own greedy tokens first nearly everywhere (a model loaded in
    # the wrong dtype, or misaligned positions, would not).
    assert measured.forced_agreement >= 0.75


def test_reference_row_scores_it_as_the_bf16_gate_would() -> None:
    fp32 = ReferenceScores(10.0, [[1, 2, 3, 4], [5, 6, 7, 8]])
    bf16 = ReferenceScores(10.05, [[1, 2, 9, 9], [5, 6, 7, 8]])
    row = accuracy.reference_row(Reference(fp32, bf16, forced_agreement=0.95))
    assert row.ppl_rise == pytest.approx(0.005)
    assert row.max_ppl_rise == accuracy.BF16.max_ppl_rise
    assert row.agreement == pytest.approx((2 / 4 + 1) / 2)
    assert row.prefix_agreement == pytest.approx((2 / 4 + 1) / 2)
    assert row.passed  # teacher-forced 0.95 >= 0.90 and +0.5% <= +1%
    worse = accuracy.reference_row(Reference(fp32, bf16, forced_agreement=0.85))
    assert not worse.passed


def test_page_shows_the_reference_table_beside_the_gate() -> None:
    fp32 = ReferenceScores(10.0, [[1, 2]])
    row = accuracy.reference_row(Reference(fp32, ReferenceScores(10.0, [[1, 3]]), 1.0))
    data = {"modes": [], "reference": [vars(row)], "reference_fp32_same": 19, "prompts": 20}
    text = "\n".join(render(data))
    assert accuracy_reference.NAME in text
    assert "on 19 of 20 prompts" in text
    assert "| 0.500 |" in text  # its free-running agreement
    assert "transformers" not in "\n".join(render({"modes": []}))


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
