"""Incremental detokenization and stop-string trimming on the real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from services.common.detokenizer import IncrementalDetokenizer
from services.gateway.stream.stop_text import StopTrimmer

TEXTS = [
    "Hello, wörld! 12345 🚀🚀 naïve café 日本語のテキスト",
    "  spaces\n\nand\ttabs ",
    "emoji 👩‍👩‍👧 end",
]


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_split_a_character_and_add_up(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == detok.text
    # Byte-level BPE splits the emoji/CJK over tokens: some pushes must have waited.
    if any(ord(c) > 0x2000 for c in text):
        assert "" in deltas[:-1]


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["Hello wor", "ld. STOP", " more"], ("STOP",), "Hello world. "),
        (["ab", "c", "d"], ("cd",), "ab"),
        (["x", "y"], (), "xy"),
        (["no stop ", "here"], ("zzz",), "no stop here"),
        (["A", "B#", "#C"], ("##", "BX"), "AB"),
    ],
)
def test_stop_strings_never_reach_the_client(
    pieces: list[str], stops: tuple[str, ...], expected: str
) -> None:
    trim = StopTrimmer(stops)
    out = "".join(trim.push(p) for p in pieces) + trim.flush()
    assert out == expected
    assert all(s not in out for s in stops)


def test_include_stop_str_in_output_keeps_the_stop_and_cuts_after_it() -> None:
    trim = StopTrimmer(("STOP",), include_stop=True)
    out = "".join(trim.push(p) for p in ["Hello ST", "OP and", " more"]) + trim.flush()
    assert out == "Hello STOP"
