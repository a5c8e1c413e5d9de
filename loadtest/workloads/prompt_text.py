"""Synthetic prompt text of a chosen length in the served model's tokens.

Lifecycle: `TextSynth.from_tokenizer(tok)` collects the vocabulary's whole-word tokens
(a leading space, then 3+ ASCII lowercase letters) once; `text(rng, n)` then joins n of
them drawn at random. Each word is one token on its own and the tokenizer's pre-split
on spaces keeps words apart, so the text re-encodes to about n tokens (the exact count
comes back in the response's usage and is what the metrics use). The gateway takes text,
not token ids, which is why the load tester has to go through words at all.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_MIN_WORDS = 64  # fewer whole-word tokens than this means an unusual tokenizer


class TextSynth:
    def __init__(self, words: Sequence[str]) -> None:
        if len(words) < _MIN_WORDS:
            raise ValueError(f"need at least {_MIN_WORDS} words, got {len(words)}")
        self.words = tuple(words)

    @classmethod
    def from_tokenizer(cls, tok: Tokenizer) -> TextSynth:
        words = []
        for token_id in range(tok.vocab_size):
            piece = tok.decode([token_id])
            body = piece[1:]
            whole_word = piece.startswith(" ") and len(body) >= 3 and body.isascii()
            if whole_word and body.isalpha() and body.islower():
                words.append(piece)
        return cls(words)

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """About `num_tokens` tokens of random words (no leading space)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        return "".join(rng.choice(self.words) for _ in range(num_tokens)).lstrip()
