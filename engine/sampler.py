"""Turning the last position's logits into one token per request.

Logit processing (penalties, biases, min_tokens, grammar masks: `logits_processing`)
comes first, batched over the rows that ask for it. Greedy rows then take the argmax in
one batched call. Sampled rows apply temperature, top-k, top-p and min_p and draw from
the request's own `torch.Generator`, so a seeded request gives the same tokens whatever
else shares the batch. A row that processing left with no token at all (a grammar mask
and min_tokens that exclude each other) falls back to its unprocessed logits rather
than fail the step.
"""

from __future__ import annotations

import torch

from engine.logits_processing import RowContext, process
from engine.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / phi: spreads consecutive positions apart


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw at output `position` (0 is its first token).

    Keying each draw on (seed, position) instead of running one generator on makes the
    sequence independent of where the draws happen: a prefill worker draws token 1, the
    decode worker the rest, and a stream moved to another worker mid-way (migration)
    continues its own sequence, all as one engine would have drawn them."""
    mixed = (seed * _GOLDEN + position + 1) % 2**64
    mixed ^= mixed >> 31
    return (mixed * _GOLDEN) % 2**63


def new_generator(seed: int | None) -> torch.Generator:
    """A request's private RNG; unseeded requests get a fresh random seed."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    *,
    contexts: list[RowContext] | None = None,
    eos_ids: frozenset[int] = frozenset(),
    allowed: torch.Tensor | None = None,
) -> list[int]:
    """One token per row of `logits` ([N, vocab], float32). `contexts` (the rows'
    settings and tokens so far) enable logit processing; `allowed` masks rows to the
    tokens their grammar accepts."""
    if contexts is not None:
        processed = process(logits, contexts, eos_ids, allowed)
        if processed is not logits:  # only processing can leave a row with no token
            dead = torch.isneginf(processed.max(dim=-1).values)
            logits = (
                torch.where(dead[:, None], logits, processed) if bool(dead.any()) else processed
            )
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, gen)
    return [int(t) for t in tokens]


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # Shift the top logit to 0 before scaling: with a tiny temperature (a denormal float
    # is a valid request) logits / T overflows to inf, softmax of inf is nan, and
    # multinomial raises inside the engine step, failing every request in the batch.
    # Shifted, the rest go to -inf at worst and the top token keeps the mass; softmax,
    # top-k and top-p are unchanged by the shift.
    row = logits.cpu()
    scaled = (row - row.max()) / p.temperature
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; keep the first.
        drop = (cum - sorted_logits.softmax(dim=-1)) >= p.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = scaled.softmax(dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen).item())
