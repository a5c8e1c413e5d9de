"""The step's last stage: logits become tokens, tokens become outputs.

Lifecycle within one `LLMEngine.step()` (schedule -> run -> this): before the model runs,
`start_masks` starts the grammar masks of the rows that sample under a constraint (they
are computed beside the forward pass); after it, `process` samples each plain row (with
its logit processing, grammar mask and log-probabilities; a request with n > 1 whose
prompt just completed forks first, its forks sampling from the same logits row), verifies
each speculating row's drafts (keeping the accepted prefix plus one sample), appends the
tokens, stop-checks each request in turn (finishing it through the scheduler; a held
prefill request's blocks are published for export) and returns one `RequestOutput` per
request that moved. `committed` forks an import when it commits (the forks' first
tokens came from the prefill worker); forks that one token already ended wait in
`take_pending` for the next step's outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from engine.finish_reason import FinishReason
from engine.fork import Forker
from engine.grammar_mask import MaskJob
from engine.kv_handoff import HeldKv, HeldKvIndex
from engine.logits_processing import RowContext
from engine.logprobs import TokenLogprobs, token_logprobs
from engine.request import Request, RequestOutput, RequestStatus
from engine.sampler import sample
from engine.scheduled_batch import ScheduledBatch
from engine.scheduler import Scheduler
from engine.speculation import Speculator, accepted
from engine.step_meter import StepMeter
from engine.stop_checker import StopChecker

#: The grammar masks a step computes beside its forward pass, and the rows they are for.
Masks = tuple[MaskJob, list[Request]]


@dataclass(frozen=True)
class OutputParts:
    """What the stage works with: the scheduler (which finishes requests), the stop rules
    and EOS ids, the forker, the index held prefill blocks are published in, the
    speculator, the step meter and the vocabulary size."""

    scheduler: Scheduler
    stop_checker: StopChecker
    eos_ids: frozenset[int]
    forker: Forker
    held: HeldKvIndex
    speculator: Speculator
    meter: StepMeter
    vocab_size: int


class OutputStage:
    def __init__(self, parts: OutputParts) -> None:
        self.parts = parts
        self.scheduler = parts.scheduler
        self._pending: list[RequestOutput] = []  # forks ended at an import's commit

    def start_masks(self, batch: ScheduledBatch) -> Masks | None:
        """Start the grammar masks of this step's constrained sampling rows, to compute
        while the model runs; None when no row is constrained."""
        rows = [
            req
            for req, n in batch.items
            if req.grammar is not None and req.num_computed_tokens + n == req.num_tokens
        ]
        if not rows:
            return None
        grammars = [r.grammar for r in rows if r.grammar is not None]
        return MaskJob(grammars, self.parts.vocab_size), rows

    def process(
        self,
        logits: torch.Tensor,
        plain: list[Request],
        speculating: list[Request],
        masks: Masks | None,
    ) -> list[RequestOutput]:
        """Outputs of a step whose first `len(plain)` logits rows are plain rows and whose
        rest are the speculating requests' positions, in order."""
        outputs = []
        if plain:
            self.parts.meter.sampled(len(plain))
            outputs += self._sample(logits[: len(plain)], plain, masks)
        if speculating:
            outputs += self._verify(logits[len(plain) :], speculating)
        return outputs

    def forget_ended(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        speculator = self.parts.speculator
        if speculator.states:
            for out in outputs:
                if out.finished:
                    speculator.forget(out.request_id)
        return outputs

    def take_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        return pending

    # -- plain rows -----------------------------------------------------------------
    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], masks: Masks | None
    ) -> list[RequestOutput]:
        """Sample each row's token (with its logit processing and grammar mask), and its
        log-probabilities where asked, from the raw logits. A request with n > 1 whose
        prompt just completed forks first: its forks are rows too, on its logits row."""
        allowed = None
        if masks is not None:
            job, rows = masks
            at = {id(r): i for i, r in enumerate(reqs)}
            allowed = job.allowed(len(reqs), [at[id(r)] for r in rows])
        reqs, parent_row = self._with_forks(reqs)
        if len(parent_row) > logits.shape[0]:
            index = torch.tensor(parent_row)
            logits = logits[index]
            allowed = None if allowed is None else allowed[index]
        contexts = [RowContext(r.sampling, r.prompt_token_ids, r.output_token_ids) for r in reqs]
        tokens = sample(
            logits, [r.sampling for r in reqs], [r.draw_generator() for r in reqs],
            contexts=contexts, eos_ids=self.parts.eos_ids, allowed=allowed,
        )  # fmt: skip
        scored = self._logprobs(logits, reqs, tokens)
        live = self.scheduler.requests
        # Forks sampled on a prefill engine first: their tokens ride on their parent's output.
        for i, req in enumerate(reqs):
            if req.request_id not in live and req.group_id:
                parent = reqs[parent_row[i]]
                parent.fork_token_ids.append(tokens[i])
                if i in scored:
                    parent.fork_logprobs.append(scored[i])
        return [
            self._append_token(req, token, scored.get(i))
            for i, (req, token) in enumerate(zip(reqs, tokens, strict=True))
            if req.request_id in live
        ]

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, reqs: list[Request], tokens: list[int]
    ) -> dict[int, TokenLogprobs]:
        """The rows' log-probabilities, for the rows that asked for them."""
        asked = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
        if not asked:
            return {}
        values = token_logprobs(
            logits[torch.tensor(asked)],
            [tokens[i] for i in asked],
            [reqs[i].sampling.logprobs or 0 for i in asked],
        )
        return dict(zip(asked, values, strict=True))

    def _with_forks(self, reqs: list[Request]) -> tuple[list[Request], list[int]]:
        """The rows plus the forks of requests with n > 1 about to sample their first
        token, and each row's logits row (a fork samples from its parent's)."""
        forker = self.parts.forker
        rows, parent_row = list(reqs), list(range(len(reqs)))
        for i, req in enumerate(reqs):
            if req.sampling.n == 1 or req.forked or req.group_id or req.output_token_ids:
                continue
            req.forked = True
            for index in range(1, req.sampling.n):
                if req.hold_kv:  # prefill: sampled only, the decode engine forks
                    rows.append(forker.sampled_only(req, index))
                else:
                    rows.append(forker.spawn(req, index, []))
                parent_row.append(i)
        return rows, parent_row

    def _append_token(
        self, req: Request, token: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        first = req.first_token_time is None
        if first:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token)
        if req.grammar is not None:
            req.grammar.advance([token])
        reason = self.parts.stop_checker.check(req)
        if reason is not None:
            self.scheduler.finish(req, reason)
            if req.status is RequestStatus.HELD_FOR_EXPORT:
                self.parts.held.publish(HeldKv.of(req))
        out = output_of(req, [token])
        prompt = tuple(req.prompt_logprobs) if first else ()
        if logprobs is None and not prompt:
            return out
        return replace(out, logprobs=(logprobs,) if logprobs else (), prompt_logprobs=prompt)

    # -- speculating rows -------------------------------------------------------------
    def _verify(self, logits: torch.Tensor, reqs: list[Request]) -> list[RequestOutput]:
        """Sample every position of each speculating request (its last token's, then each
        draft's) as plain decoding would there, keep the drafts up to the first that
        differs from its sample plus one sample (`speculation.accepted`), and move the
        request on by what it kept (`speculation.py` says why this is exact)."""
        rows: list[RowContext] = []
        generators: list[torch.Generator | None] = []
        for req in reqs:
            drafts = req.draft_token_ids
            for j in range(len(drafts) + 1):
                output = req.output_token_ids + drafts[:j]
                rows.append(RowContext(req.sampling, req.prompt_token_ids, output))
                generators.append(req.draw_generator_at(len(output)))
        samples = sample(
            logits, [r.params for r in rows], generators, contexts=rows,
            eos_ids=self.parts.eos_ids,
        )  # fmt: skip
        outputs, at = [], 0
        for req in reqs:
            drafts, req.draft_token_ids = req.draft_token_ids, []
            tokens = accepted(samples[at : at + len(drafts) + 1], drafts)
            at += len(drafts) + 1
            self.parts.speculator.record(req, len(drafts), len(tokens) - 1)
            req.spec_drafted += len(drafts)
            req.spec_accepted += len(tokens) - 1
            outputs.append(self._keep(req, tokens))
        return outputs

    def _keep(self, req: Request, tokens: list[int]) -> RequestOutput:
        """Append a verification's tokens, each stop-checked in turn (one that ends the
        request drops those after it); the request's computed tokens then reach all but
        its last token, the blocks only rejected drafts reached are freed, and then a stop
        ends it."""
        kept: list[int] = []
        reason = None
        for token in tokens:
            req.output_token_ids.append(token)
            kept.append(token)
            reason = self.parts.stop_checker.check(req)
            if reason is not None:
                break
        self.parts.meter.sampled(len(kept))
        self.scheduler.advance(req, req.num_tokens - 1 - req.num_computed_tokens)
        self.scheduler.trim_drafts(req)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return output_of(req, kept)

    # -- an import's commit -------------------------------------------------------------
    def committed(self, req: Request) -> FinishReason | None:
        """An imported request's KV landed: fork it (n > 1: the forks start from the first
        tokens the prefill worker sampled), then stop-check its own first token; returns
        why that token already ended it (its blocks then freed), or None."""
        req.forked = True
        for index, token in enumerate(req.fork_token_ids, start=1):
            fork = self.parts.forker.spawn(req, index, [token])
            ended = self.parts.stop_checker.check(fork)
            if ended is not None:  # its first token (sent from prefill) already ended it
                self.scheduler.finish(fork, ended)
                self._pending.append(output_of(fork, []))
        reason = self.parts.stop_checker.check(req)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return reason


def output_of(req: Request, new_tokens: list[int]) -> RequestOutput:
    """What one step produced for `req`: its new tokens and where it stands."""
    return RequestOutput(
        request_id=req.group,
        index=req.index,
        fork_token_ids=tuple(req.fork_token_ids),
        fork_logprobs=tuple(req.fork_logprobs),
        new_token_ids=new_tokens,
        finished=req.finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_output_tokens=len(req.output_token_ids),
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        spec_drafted=req.spec_drafted,
        spec_accepted=req.spec_accepted,
    )
