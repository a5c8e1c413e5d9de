"""Incremental detokenization: token ids in, text deltas out, never a broken character.

Lifecycle: one `IncrementalDetokenizer` per stream. `push(ids)` returns the new text
since the last call; a token that ends in the middle of a UTF-8 sequence (byte-level BPE
splits emoji and CJK across tokens) yields nothing until the sequence completes.
`flush()` returns whatever is left at the end of the stream.

Decoding the whole output each time would be quadratic; instead a small window of
already-emitted tokens is re-decoded together with the new ones (tokenizers merge
spaces and bytes across token boundaries, so a token cannot be decoded alone).
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_start = 0  # window start: tokens before it are settled for good
        self._read_start = 0  # tokens before it have been emitted as text
        self.text = ""

    def fresh(self) -> IncrementalDetokenizer:
        """A new stream's detokenizer with the same settings (a fork's text)."""
        return IncrementalDetokenizer(self._tok, skip_special_tokens=self._skip)

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_start : self._read_start])
        full = self._decode(self._ids[self._prefix_start :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            # An incomplete UTF-8 sequence: wait for the tokens that finish it.
            return ""
        delta = full[len(prefix) :]
        self._prefix_start = self._read_start
        self._read_start = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix = self._decode(self._ids[self._prefix_start : self._read_start])
        full = self._decode(self._ids[self._prefix_start :])
        delta = full[len(prefix) :]
        self._prefix_start = self._read_start = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
