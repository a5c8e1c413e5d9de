"""Per-request logit processing, batched: penalties, biases, min_tokens and grammar masks.

Lifecycle: the sampler calls `process` once per step with the step's logits rows ([N,
vocab] float32) and their requests. Only rows whose request asks for processing
(`SamplingParams.processes_logits`) or carries a grammar mask are touched, and those
together, by tensor operations over all of them at once: a batch that mixes processed
and plain requests stays one batched sample, and each row's result depends only on its
own request (seeded requests stay batch-invariant). A step with no such row returns the
logits untouched, without building a tensor.

Order, as vLLM and HF apply them: repetition penalty (HF's: over prompt and output,
positive logits divided, negative multiplied), frequency and presence penalties
(OpenAI's: over the output, minus freq x count and presence once seen), `logit_bias`
(added), then `min_tokens` (EOS and stop ids at -inf while the output is shorter), then
the grammar's allowed-token mask.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowContext:
    """What processing needs of one row's request: its settings and its tokens so far."""

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]


def process(
    logits: torch.Tensor,
    rows: Sequence[RowContext],
    eos_ids: Collection[int],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`logits` with each row's processing applied (a new tensor when anything applies).
    `allowed` ([N, vocab] bool, True = may be sampled) masks grammar-constrained rows."""
    picked = [i for i, r in enumerate(rows) if r.params.processes_logits]
    if not picked and allowed is None:
        return logits
    out = logits.clone()
    if picked:
        index = torch.tensor(picked)
        sub = [rows[i] for i in picked]
        out[index] = _apply(out[index], sub, eos_ids)
    if allowed is not None:
        out = out.masked_fill(~allowed, float("-inf"))
    return out


def _apply(
    logits: torch.Tensor, rows: Sequence[RowContext], eos_ids: Collection[int]
) -> torch.Tensor:
    vocab = logits.shape[-1]
    logits = _repetition(logits, rows, vocab)
    logits = _frequency_presence(logits, rows, vocab)
    logits = _bias(logits, rows)
    return _min_tokens(logits, rows, eos_ids, vocab)


def _scatter(
    rows: int, vocab: int, entries: list[tuple[int, int]], values: list[float]
) -> torch.Tensor:
    """A [rows, vocab] tensor summing `values` at (row, token) `entries`."""
    out = torch.zeros(rows, vocab)
    if entries:
        r, t = zip(*entries, strict=True)
        out.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(values), accumulate=True)
    return out


def _per_row(rows: Sequence[RowContext], name: str) -> torch.Tensor:
    return torch.tensor([[float(getattr(r.params, name))] for r in rows])


def _repetition(logits: torch.Tensor, rows: Sequence[RowContext], vocab: int) -> torch.Tensor:
    if all(r.params.repetition_penalty == 1.0 for r in rows):
        return logits
    entries = [(i, t) for i, r in enumerate(rows) for t in {*r.prompt, *r.output}
               if r.params.repetition_penalty != 1.0]  # fmt: skip
    seen = _scatter(len(rows), vocab, entries, [1.0] * len(entries)) > 0
    penalty = _per_row(rows, "repetition_penalty")
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def _frequency_presence(
    logits: torch.Tensor, rows: Sequence[RowContext], vocab: int
) -> torch.Tensor:
    if all(r.params.frequency_penalty == 0 and r.params.presence_penalty == 0 for r in rows):
        return logits
    entries = [(i, t) for i, r in enumerate(rows) for t in r.output]
    counts = _scatter(len(rows), vocab, entries, [1.0] * len(entries))
    frequency = _per_row(rows, "frequency_penalty")
    presence = _per_row(rows, "presence_penalty")
    return logits - frequency * counts - presence * (counts > 0).float()


def _bias(logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
    entries = [(i, t) for i, r in enumerate(rows) for t, _ in r.params.logit_bias]
    if not entries:
        return logits
    values = [b for r in rows for _, b in r.params.logit_bias]
    return logits + _scatter(logits.shape[0], logits.shape[-1], entries, values)


def _min_tokens(
    logits: torch.Tensor, rows: Sequence[RowContext], eos_ids: Collection[int], vocab: int
) -> torch.Tensor:
    entries = [
        (i, t)
        for i, r in enumerate(rows)
        if len(r.output) < r.params.min_tokens
        for t in {*eos_ids, *r.params.stop_token_ids}
        if t < vocab
    ]
    if not entries:
        return logits
    banned = _scatter(len(rows), vocab, entries, [1.0] * len(entries)) > 0
    return logits.masked_fill(banned, float("-inf"))
