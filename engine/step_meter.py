"""Prefill and decode work of one engine: what its steps did, and the prefill still owed.

Lifecycle: the engine owns one `StepMeter`. In each `step()`, once the scheduler has
placed the batch and before the model advances any request, `count(batch)` splits it
into prefill tokens and decodes (a request is prefilling while its prompt is not fully
computed); `sampled(n)` adds the tokens the step generated; `stop(seconds)` ends the
step, adding its wall time to the busy totals when it counted work (a step that ran
nothing adds none). The totals only grow: a reader computes throughput from the
difference of two snapshots (`EngineStats.*_total`), and nothing here resets.

With a `DecodeRoof` (engine/decode_roof.py), a step that ran only decodes also adds its
wall time to `decode_only_busy_s` and its roof, the least time its reads could take at
its rows' context, to `decode_roof_s`: their ratio is how close decode runs to memory
bandwidth.

`prefill_backlog` reads the other side, what is still to prefill, from the scheduler's
queues at snapshot time.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.decode_roof import DecodeRoof
from engine.priority import Priority
from engine.request import Request
from engine.scheduled_batch import ScheduledBatch
from engine.stats import ClassCounts


class StepMeter:
    """Cumulative counters since the engine started. Not thread-safe: the engine calls it
    under its step lock and copies the totals into each stats snapshot."""

    def __init__(self, roof: DecodeRoof | None = None) -> None:
        self.roof = roof
        self.decode_only_busy_s = 0.0  # wall time of steps that ran only decodes
        self.decode_roof_s = 0.0  # the roof of those steps (`DecodeRoof.step_s`)
        self.prefill_tokens = 0  # tokens computed by prefill chunks (recomputes included)
        self.prefill_busy_s = 0.0  # wall time of steps that ran a prefill chunk
        self.decode_tokens = 0  # tokens sampled (every generated token, the first included)
        self.decode_steps = 0  # steps that ran at least one decode
        self.decode_busy_s = 0.0  # wall time of those steps
        self.busy_s = 0.0  # wall time of every step that ran the model
        # The step in flight: what `count` saw, settled by `stop`.
        self._step_prefill = 0
        self._step_decodes = 0
        self._step_context = 0  # the decode rows' context tokens (their KV read)

    def count(self, batch: ScheduledBatch) -> None:
        """Split a step's batch into prefill tokens and decodes. Call before `advance`:
        afterwards a finished prompt's last chunk looks like a decode."""
        prefill = decodes = 0
        # One-token entries are decodes or one-token prefill chunks (ScheduledBatch.add).
        for req in batch.decodes:
            if _prefilling(req):
                prefill += 1
            else:
                decodes += 1
                self._step_context += req.num_computed_tokens
        for req, n in batch.prefills:
            if req.draft_token_ids:  # a decode verifying drafts (speculation)
                decodes += 1
                self._step_context += req.num_computed_tokens
            else:
                prefill += n
        self._step_prefill += prefill
        self._step_decodes += decodes

    def sampled(self, n: int) -> None:
        self.decode_tokens += n

    def stop(self, seconds: float) -> None:
        """End the step in flight, which took `seconds` of wall time."""
        if self._step_prefill:
            self.prefill_tokens += self._step_prefill
            self.prefill_busy_s += seconds
        if self._step_decodes:
            self.decode_steps += 1
            self.decode_busy_s += seconds
        if self._step_prefill or self._step_decodes:
            self.busy_s += seconds
        if self._step_decodes and not self._step_prefill and self.roof is not None:
            self.decode_only_busy_s += seconds
            self.decode_roof_s += self.roof.step_s(self._step_context)
        self._step_prefill = self._step_decodes = self._step_context = 0


def prefill_backlog(*queues: Iterable[Request]) -> ClassCounts:
    """Tokens still to prefill over the requests in `queues`, by class (`_prefill_left`)."""
    counts = [0] * len(Priority)
    for queue in queues:
        for req in queue:
            counts[req.priority] += _prefill_left(req)
    return ClassCounts(*counts)


def _prefilling(req: Request) -> bool:
    """Whether `req`'s next tokens are prefill: its prompt's KV is not all computed. An
    imported request starts with it all computed, so it only ever decodes here."""
    return req.num_computed_tokens < req.num_prompt_tokens


def _prefill_left(req: Request) -> int:
    """Tokens `req` must compute before it decodes: its prompt's uncomputed tokens, plus,
    after a preemption, the output tokens it recomputes with them (the same prefill work);
    0 once it decodes."""
    return req.num_tokens - req.num_computed_tokens if _prefilling(req) else 0
