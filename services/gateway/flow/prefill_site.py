"""Conditional disaggregation: whether a request's prompt takes the prefill hop or is
prefilled by its decode worker.

The hop pays when a prompt is long: the prefill pool computes it without stalling the
decode batch, and the KV transfer is small next to the compute. A short prompt, or one
whose prefix the decode worker already caches, gains nothing from it and pays a second
queue and a transfer (on the headline's short-prompt chat point colocated matched
disaggregated and its TTFT p90 was half). So the gateway decides per request, after
routing (which placed both sides and knows the decode worker's cache model):

- `LOCAL / SHORT_PROMPT`: the prompt's uncached tokens are at most
  `local_prefill_max_tokens` (uncached: its length less what the router's model of the
  decode worker's prefix cache vouches for; with nothing vouched, `SHORT_PROMPT`, else
  `CACHED_PREFIX`);
- `LOCAL / PREFILL_BUSY`: more uncached tokens than that but at most
  `BUSY_FACTOR` times as many, while the chosen prefill worker's queue would take longer
  than `local_prefill_busy_s` and the decode worker's own queue is shorter: waiting for
  the prefill pool would cost more than the decode batch loses;
- `DISAGGREGATED / DECODE_BUSY`: a prompt that would go local by its length, while the
  decode worker's own prefill queue is longer than `local_prefill_busy_s` and the
  prefill worker's is shorter: local prefills would pile up in the decode batch (and
  stall its streams) while the prefill worker idles;
- `DISAGGREGATED / LONG_PROMPT`: anything longer;
- `DISAGGREGATED / ALWAYS`: `local_prefill_max_tokens` is 0 (the decision is off).

A queue's length in seconds is the worker's last signal: its prompt tokens waiting
divided by its measured prefill speed (0 while it has not measured one).

Elastic roles (`elastic`, the gateway's `--elastic-roles`): a prefill worker with room
also decodes. Before any of the above the policy asks whether the chosen prefill worker
should run the request whole, prefill and decode in one engine, with no hop and no
transfer (`PREFILL_WORKER / DECODE_LOADED`). It does when
- the prompt is one a decode worker could prefill too (at most `local_limit` uncached
  tokens): a long prompt keeps the split, so its decode leaves the prefill worker free;
- the gateway sent the prefill worker no long prompt (`LONG_PROMPT`) in the last
  `worker_loads.RECENT_WINDOW_S`: a worker serving long prompts will likely get the
  next one, and every stream it decodes would wait through that prefill's chunks;
- its prefill queue is no longer than the decode worker's (or under `IDLE_QUEUE_S`);
- it carries fewer streams than the decode worker, which carries at least
  `MIN_DECODE_STREAMS`.
So on chat traffic the two workers act as two mixed ones, about evenly loaded, and on a
long-prompt mix the prefill worker keeps to prefill. Every stream placed is counted
(`LoadView.placed`), so a burst inside one signal interval still splits; a prefill
attempt that fails takes its count back (`SitePolicy.withdraw`) before the stream is
placed again, so a retried stream counts once.

The choice is a span attribute and a metric (`StreamTelemetry.disaggregation`). Mixed
pools have no choice to make and are not counted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.gateway.flow.worker_loads import LoadView, NoLoads
from services.router.worker_signal import IDLE_QUEUE_S, MIN_DECODE_STREAMS

#: A prompt up to this many times the local limit still goes local when the prefill
#: pool is busy: the decode batch absorbs a few hundred tokens more at a small ITL cost.
BUSY_FACTOR = 4


class PrefillSite(enum.Enum):
    DISAGGREGATED = "disaggregated"  # a prefill worker computes it, the decode one pulls
    LOCAL = "local"  # the decode worker computes it in its own batch
    PREFILL_WORKER = "prefill_worker"  # the prefill worker runs it whole (elastic roles)


class SiteReason(enum.Enum):
    LONG_PROMPT = "long_prompt"
    SHORT_PROMPT = "short_prompt"
    CACHED_PREFIX = "cached_prefix"
    PREFILL_BUSY = "prefill_busy"
    DECODE_BUSY = "decode_busy"
    DECODE_LOADED = "decode_loaded"
    ALWAYS = "always"


@dataclass(frozen=True)
class SiteChoice:
    site: PrefillSite
    reason: SiteReason
    uncached_tokens: int
    # Where `choose` counted the stream, and the count's mark (None: nothing counted).
    placed_on: str = ""
    placed_mark: float | None = None


@dataclass(frozen=True)
class SitePolicy:
    """The thresholds (the gateway's `--local-prefill-max-tokens`,
    `--local-prefill-busy-s` and `--elastic-roles`) and where live loads come from
    (`loads`: none, every worker idle)."""

    local_max_tokens: int
    busy_s: float
    loads: LoadView = field(default_factory=NoLoads)
    elastic: bool = False

    def choose(
        self, prompt_tokens: int, cached_tokens: int, prefill_worker: str, decode_worker: str
    ) -> SiteChoice:
        """Where the request's prompt is prefilled (and, elastic, which worker decodes);
        counts the stream as placed on the worker that will decode it."""
        choice = self.prefill_site(prompt_tokens, cached_tokens, prefill_worker, decode_worker)
        if self._prefill_worker_has_room(choice, prefill_worker, decode_worker):
            choice = SiteChoice(
                PrefillSite.PREFILL_WORKER, SiteReason.DECODE_LOADED, choice.uncached_tokens
            )
        on = prefill_worker if choice.site is PrefillSite.PREFILL_WORKER else decode_worker
        mark = self.loads.placed(on)
        if choice.reason is SiteReason.LONG_PROMPT:
            self.loads.long_prompt_sent(prefill_worker)
        return SiteChoice(choice.site, choice.reason, choice.uncached_tokens, on, mark)

    def withdraw(self, choice: SiteChoice) -> None:
        """Take back the stream `choose` counted for `choice`: its prefill failed, and it
        is placed again (counted anew) or ends."""
        if choice.placed_mark is not None:
            self.loads.withdraw(choice.placed_on, choice.placed_mark)

    def prefill_site(
        self, prompt_tokens: int, cached_tokens: int, prefill_worker: str, decode_worker: str
    ) -> SiteChoice:
        """Conditional disaggregation alone (LOCAL or DISAGGREGATED), counting nothing:
        for a stream that moves, whose decode worker is already chosen."""
        uncached = max(1, prompt_tokens - cached_tokens)
        if self.local_max_tokens <= 0:
            return SiteChoice(PrefillSite.DISAGGREGATED, SiteReason.ALWAYS, uncached)
        if uncached <= self.local_max_tokens:
            if self._busier(decode_worker, than=prefill_worker):
                return SiteChoice(PrefillSite.DISAGGREGATED, SiteReason.DECODE_BUSY, uncached)
            reason = SiteReason.CACHED_PREFIX if cached_tokens > 0 else SiteReason.SHORT_PROMPT
            if prompt_tokens <= self.local_max_tokens:
                reason = SiteReason.SHORT_PROMPT  # short whatever the cache holds
            return SiteChoice(PrefillSite.LOCAL, reason, uncached)
        if uncached <= self.local_limit() and self._busier(prefill_worker, than=decode_worker):
            return SiteChoice(PrefillSite.LOCAL, SiteReason.PREFILL_BUSY, uncached)
        return SiteChoice(PrefillSite.DISAGGREGATED, SiteReason.LONG_PROMPT, uncached)

    def _prefill_worker_has_room(self, choice: SiteChoice, prefill: str, decode: str) -> bool:
        """Elastic roles: whether the prefill worker should run the request whole."""
        if not self.elastic or choice.reason is SiteReason.ALWAYS:
            return False
        if choice.uncached_tokens > self.local_limit():
            return False  # a long prompt: its decode leaves the prefill worker free
        loads = self.loads
        if loads.long_prompt_lately(prefill):
            return False
        if loads.queue_s(prefill) > max(loads.queue_s(decode), IDLE_QUEUE_S):
            return False
        on_decode = loads.streams(decode)
        return on_decode >= MIN_DECODE_STREAMS and loads.streams(prefill) < on_decode

    def local_limit(self) -> int:
        """The most prompt tokens a decode worker may ever prefill: `BUSY_FACTOR` times
        the local limit under the busy rule, the limit itself without it (0: none)."""
        factor = BUSY_FACTOR if self.busy_s > 0 else 1
        return max(self.local_max_tokens, 0) * factor

    def _busier(self, worker: str, *, than: str) -> bool:
        """Whether `worker`'s prefill queue is past `busy_s` and longer than `than`'s."""
        if self.busy_s <= 0:
            return False
        waiting = self.loads.queue_s(worker)
        return waiting > self.busy_s and self.loads.queue_s(than) < waiting
