"""Structured output: grammars compiled once, a matcher per request, token masks per step.

Built on llguidance (see docs/engine.md "Structured output" for why it and not xgrammar
or outlines-core). Lifecycle:
- `GrammarCompiler(tokenizer_json, vocab_size, eos_id)` is built once per engine (about a
  second: it indexes the vocabulary). `matcher(spec)` turns a `GuidedSpec` into a fresh
  `Grammar` for one request, in the caller's thread (add_request / reserve_import), so a
  slow compile never holds a step; an invalid schema, regex or grammar raises
  InvalidRequestError naming `guided.spec` (or `guided.choices`).
- `Grammar` follows its request: `advance(tokens)` feeds sampled tokens (an imported
  request feeds the first token the prefill worker sampled under the same grammar),
  `complete` says the grammar can end and nothing else may follow (the stop checker ends
  the request with STOP), `fork()` copies the state. Preemption needs nothing: the
  request keeps its output tokens and the matcher their state.
- `MaskJob` (`engine/grammar_mask.py`) turns a step's grammars into token masks. This
  module does not import torch: gateways compile grammars to check requests.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance

from engine.errors import InvalidRequestError
from engine.sampling_params import GuidedKind, GuidedSpec
from engine.tokenizer import Tokenizer

#: Compiled grammars kept per engine (the text llguidance builds from a spec).
CACHE_SIZE = 256


class Grammar:
    """One request's grammar state (an llguidance matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def advance(self, tokens: Sequence[int]) -> None:
        """Feed sampled tokens; a token the grammar refused leaves it in an error state,
        which `complete` reports (the request then stops rather than run unconstrained)."""
        for token in tokens:
            if not self._matcher.consume_token(token):
                return

    @property
    def complete(self) -> bool:
        """The output satisfies the grammar and it accepts nothing more (or it failed)."""
        return bool(self._matcher.is_stopped())

    @property
    def failed(self) -> bool:
        return bool(self._matcher.is_error())

    def fork(self) -> Grammar:
        return Grammar(self._matcher.deep_copy())

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher


class LazyGrammarCompiler:
    """A tokenizer's `GrammarCompiler`, built on first call (it indexes the vocabulary,
    which a deployment without structured output never needs); thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None

    def __call__(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.of(self._tokenizer, self._vocab_size)
            return self._compiler


class GrammarCompiler:
    """Specs -> grammars for one tokenizer, with a bounded cache of compiled texts."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos_id
        )
        self._cache: OrderedDict[GuidedSpec, str] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
        return cls(tokenizer.to_json(), vocab_size, tokenizer.eos_token_id)

    def matcher(self, spec: GuidedSpec) -> Grammar:
        """A fresh grammar state for `spec`; InvalidRequestError if it does not compile."""
        text = self._grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(_field(spec), f"does not compile: {matcher.get_error()}")
        return Grammar(matcher)

    def _grammar_text(self, spec: GuidedSpec) -> str:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        text = _grammar_of(spec)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise InvalidRequestError(_field(spec), f"is not valid: {error}")
        with self._lock:
            self._cache[spec] = text
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return text


def _field(spec: GuidedSpec) -> str:
    return "guided.choices" if spec.kind is GuidedKind.CHOICE else "guided.spec"


def _grammar_of(spec: GuidedSpec) -> str:
    """llguidance's grammar text for a spec."""
    if spec.kind is GuidedKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.kind is GuidedKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.spec)
        except ValueError as exc:
            raise InvalidRequestError("guided.spec", f"is not JSON: {exc}") from None
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as exc:
            raise InvalidRequestError("guided.spec", f"is not a JSON schema: {exc}") from None
    if spec.kind is GuidedKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind is GuidedKind.CHOICE:
        return llguidance.grammar_from("choice", json.dumps(list(spec.choices)))
    try:
        return llguidance.grammar_from("grammar", spec.spec)
    except ValueError as exc:
        raise InvalidRequestError("guided.spec", f"is not a grammar: {exc}") from None
