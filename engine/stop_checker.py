"""Deciding, after each sampled token, whether a request is done and why."""

from __future__ import annotations

from engine.finish_reason import FinishReason
from engine.request import Request
from engine.tokenizer import Tokenizer


class StopChecker:
    """EOS, stop token ids, a completed grammar, stop strings, then max_tokens and the
    context limit, in that order.

    Stop strings are matched on the decoded tail of the output: only the last few tokens
    are decoded each step, enough to cover the longest stop string (a token is at least
    one byte, and a stop string's characters are at most 4 bytes each).
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, req: Request) -> FinishReason | None:
        """Why the last output token ends `req` (setting its `stop_reason`), or None."""
        token = req.output_token_ids[-1]
        p = req.sampling
        if not p.ignore_eos and token in self.eos_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if token in p.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if req.grammar is not None and req.grammar.complete:
            return FinishReason.STOP  # the structured output is whole
        if p.stop:
            hit = self._stop_string(req)
            if hit is not None:
                req.stop_reason = hit
                return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _stop_string(self, req: Request) -> str | None:
        longest = max(len(s) for s in req.sampling.stop)
        tail = self.tokenizer.decode(req.output_token_ids[-(4 * longest + 2) :])
        for s in req.sampling.stop:
            if s in tail:
                return s
        return None
