"""Log-probabilities a request asked for, as the engine reports them.

Lifecycle: the sampler computes one `TokenLogprobs` per sampled token of a request that
set `SamplingParams.logprobs` (the chosen token and the top N), and the model runner one
per prompt position 1..end for `prompt_logprobs` (position 0 has no context, so no
value). They ride on `RequestOutput` to the worker, which puts them on the wire
(`pdserve.v1.TokenLogprobs`); the gateway formats them for OpenAI clients.

Values are the natural-log softmax of the model's raw float32 logits: before penalties,
biases, grammar masks and temperature, the convention of vLLM's default and of
HF transformers' `log_softmax(logits)` that evaluation harnesses compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen (or prompt) token, its rank among all tokens (1 = the
    most likely) and the `top` N most likely tokens, most likely first."""

    chosen: Logprob
    rank: int = 1
    top: tuple[Logprob, ...] = field(default=())


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprobs]:
    """Row i's log-probability of `tokens[i]`, its rank and the top `tops[i]` tokens, from
    raw logits ([N, vocab]); one log-softmax and one top-k for all rows."""
    import torch  # here, not at import: gateways read this module's types only

    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens)[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    k = max(tops)
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    values, ids = top_values.tolist(), top_ids.tolist()
    out = []
    for i, token in enumerate(tokens):
        top = tuple(
            Logprob(t, v) for t, v in zip(ids[i][: tops[i]], values[i][: tops[i]], strict=True)
        )
        out.append(TokenLogprobs(Logprob(token, float(chosen[i, 0])), int(ranks[i]), top))
    return out
