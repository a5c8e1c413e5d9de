"""The request contract: what a caller asks an engine to run, as every boundary speaks it.

Lifecycle: a front door builds one `RequestSpec` per request (the gateway from a client's
call, a worker from its RPC through `services.common.request_codec`, a test or benchmark
directly) and hands it, unchanged, to the engine's intake (`LLMEngine.add_request`), to
the KV import port (`KvHandoff.reserve_import`) or to the importer (`KvImporter.import_kv`).
`engine.request_check.check_request` is the one check of a spec against a model's limits;
the engine then turns it into its own mutable `Request` (`engine.intake`). A spec is
frozen: code that needs a variant (the prefill hop's one token, a migrated stream's
tokens so far) makes a new one with `dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.adapter_ref import AdapterRef
from engine.priority import Priority
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    """One generation request.

    `request_id` is the id the engine tracks it by ("": the engine makes one up);
    `cache_salt` keys its prefix-cache blocks (the tenant: tenants never share blocks),
    and `cache_weight` is that tenant's share of the cache when it must evict (> 0);
    `priority` orders admission and preemption; past `deadline` (`time.monotonic()`
    seconds, None: none) a preempted request ends with FinishReason.DEADLINE instead of
    being recomputed; `adapter` names a LoRA adapter (None: the base model);
    `resume_token_ids` are output tokens another engine already produced for it (a
    stream migrated after its worker died): the request goes on after them as if this
    engine had made them.
    """

    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    request_id: str = ""
    cache_salt: str = ""
    cache_weight: float = 1.0
    priority: Priority = Priority.STANDARD
    deadline: float | None = None
    adapter: AdapterRef | None = None
    resume_token_ids: Sequence[int] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
