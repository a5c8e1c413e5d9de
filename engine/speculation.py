"""Speculative decoding: draft tokens proposed cheaply, verified by the model in one step.

Lifecycle per engine step (`LLMEngine._run_batch`): before the scheduler places the
batch, `Speculator.propose` gives each eligible running decode its draft tokens
(`Request.draft_token_ids`), unless the decode batch is too large to gain (the step is
then compute-bound) or the request is paused. The scheduler places such a decode as one
chunk of 1 + k tokens (its last token and the drafts) in the same batched forward pass
as the plain decodes and prefill chunks; the runner returns logits for each of those
k + 1 positions. The engine samples every position with the request's own processing,
as if the drafts before it were output (`RowContext`), each with the generator of its
output position, and `accepted` keeps the drafts up to the first that differs from
the sample there, plus that sample (or, with every draft kept, the sample after the
last): between 1 and k + 1 tokens from one step. `Speculator.record` then adapts the
request's draft length. The KV slots of rejected drafts lie past the request's computed
tokens: the engine frees whole blocks of them, and the rest are overwritten before a
block is ever full and published to the prefix cache.

Why this is exact. Drafts are deterministic proposals (a one-hot draft distribution).
For those, the modified rejection sampling of speculative decoding (accept draft d with
probability min(1, p(d) / q(d)) = p(d), else draw from p without d, renormalised) is the
same as drawing x ~ p and accepting d when x == d, emitting x otherwise: every emitted
token is a draw from the target distribution given the tokens before it. And since a
seeded request's draw at output position i is keyed on (seed, i) (`position_seed`),
the sample at each position is the one plain decoding would draw there: seeded and
greedy output is token-identical with speculation on or off. Unseeded requests keep one
generator running, so their draws are fresh at every position (exact in distribution).

Drafts come from the request's own tokens (prompt lookup, `NgramIndex`): the longest
recent n-gram that ended the sequence is looked up where it last occurred before, and
the tokens that followed it there are the draft. It costs a dictionary lookup per step,
needs no second model, and wins where output repeats the prompt: summaries, edits,
extraction, code, retrieval-augmented answers. Or, with `--spec-draft-model`, from a
smaller model of the same tokenizer (`draft_model.py`, a `DraftSource`): its greedy
continuation, from its own paged KV pool.

Requests that do not speculate: n > 1, structured output (a grammar's state would have
to be rolled back over rejected drafts), log-probabilities asked (per-position scoring is
not wired), and prefill-side requests (`hold_kv`: they stop after one token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.config import SpecConfig, SpecMode
from engine.request import Request


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a token sequence last ended, updated as
    tokens are appended. `draft(k)` is up to k tokens that followed the previous
    occurrence of the sequence's longest matching suffix n-gram."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> end position (exclusive) of its latest occurrence, and the one before
        # (the suffix's own latest occurrence is the suffix itself).
        self._last: dict[tuple[int, ...], int] = {}
        self._prev: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self.tokens[end - n : end])
                if gram in self._last:
                    self._prev[gram] = self._last[gram]
                self._last[gram] = end

    def draft(self, k: int) -> list[int]:
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            earlier = self._prev.get(tuple(self.tokens[end - n : end]))
            if earlier is not None:
                return self.tokens[earlier : earlier + k]
        return []


@dataclass
class SpecState:
    """One request's drafting state: its index over prompt + output (kept up to date
    only when drafts come from prompt lookup), its draft length and acceptance, and
    (auto) how many steps it still sits out. Its counts of drafted and kept tokens are
    the request's own (`Request.spec_drafted`, `spec_accepted`)."""

    index: NgramIndex
    draft_len: int
    recent: float = 1.0  # acceptance rate, exponentially weighted over its verifications
    paused: int = 0


class DraftSource(Protocol):
    """Where drafts come from when not from prompt lookup: a draft model."""

    def propose(self, reqs: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


def eligible(req: Request) -> bool:
    """Whether `req` may speculate at all (the module docstring says why not)."""
    p = req.sampling
    return (
        p.n == 1
        and req.grammar is None
        and p.logprobs is None
        and p.prompt_logprobs is None
        and not req.hold_kv
        and not req.group_id
    )


def accepted(samples: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens one verification emits: the drafts up to the first that differs from
    the sample at its position, then the sample there (after all k drafts: the sample
    at position k + 1). `samples` has len(drafts) + 1 entries."""
    out: list[int] = []
    for sample, draft in zip(samples, drafts, strict=False):
        out.append(sample)
        if sample != draft:
            return out
    out.append(samples[len(drafts)])
    return out


class Speculator:
    """Proposes drafts and adapts their length per request. Lives in the engine; called
    under its step lock only."""

    EWMA = 0.3  # weight of the newest verification in `SpecState.recent`

    def __init__(self, config: SpecConfig, draft: DraftSource | None = None) -> None:
        self.config = config
        self.draft = draft  # a draft model (`draft_model.py`); None: prompt lookup
        self.states: dict[str, SpecState] = {}
        self.drafted_total = 0  # draft tokens verified
        self.accepted_total = 0  # of those, kept
        self.verifications_total = 0  # request-steps that verified drafts

    @property
    def enabled(self) -> bool:
        return self.config.mode is not SpecMode.OFF

    def propose(self, decodes: Sequence[Request]) -> None:
        """Set the draft tokens of each eligible request in `decodes` (the running
        requests about to decode one token)."""
        cfg = self.config
        if cfg.mode is SpecMode.AUTO and len(decodes) > cfg.max_batch:
            return
        asked: list[tuple[Request, int]] = []
        for req in decodes:
            if not eligible(req):
                continue
            state = self._state(req)
            if state.paused:
                state.paused -= 1
                continue
            room = req.sampling.max_tokens - len(req.output_token_ids) - 1
            k = min(state.draft_len, room)
            if k > 0:
                asked.append((req, k))
        if self.draft is not None:
            drafts = self.draft.propose([r for r, _ in asked], [k for _, k in asked])
            for (req, _), tokens in zip(asked, drafts, strict=True):
                req.draft_token_ids = tokens
            return
        for req, k in asked:
            req.draft_token_ids = self.states[req.request_id].index.draft(k)

    def _state(self, req: Request) -> SpecState:
        state = self.states.get(req.request_id)
        if state is None:
            index = NgramIndex(self.config.min_ngram, self.config.max_ngram)
            state = SpecState(index=index, draft_len=self.config.max_draft)
            self.states[req.request_id] = state
        if self.draft is None:  # a draft model needs no index
            state.index.extend(req.all_token_ids[len(state.index.tokens) :])
        return state

    def record(self, req: Request, drafted: int, kept: int) -> None:
        """`req` verified `drafted` drafts and kept `kept` of them: adapt (auto)."""
        self.drafted_total += drafted
        self.accepted_total += kept
        self.verifications_total += 1
        state = self.states.get(req.request_id)
        if state is None or self.config.mode is not SpecMode.AUTO:
            return
        state.recent += self.EWMA * (kept / drafted - state.recent)
        if kept == drafted:
            state.draft_len = min(state.draft_len + 1, self.config.max_draft)
        else:
            state.draft_len = max(1, kept + 1)
        if state.recent < self.config.min_acceptance:
            state.paused = self.config.pause_steps
            state.recent = self.config.min_acceptance  # one more chance after the pause
            state.draft_len = 1

    def forget(self, request_id: str) -> None:
        """A request ended: drop its state (and its draft model's shadow)."""
        self.states.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)
