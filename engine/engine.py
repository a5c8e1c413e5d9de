"""The engine: one model, one paged KV pool, one scheduler; the API the workers call.

Lifecycle: `LLMEngine(config)` builds its parts (`engine.builder`: the model, converted
on first use for the default one, its weights, the KV pool sized from the memory budget,
all logged). Callers then `add_request(spec)` / `abort(id)` from any thread (they only
queue, `engine.intake`), and one thread calls `step()` in a loop while
`has_unfinished()`. Each step is a pipeline:
  1. intake: deferred calls run (released blocks freed, imports committed), then queued
     adds and aborts apply (an abort frees the request's blocks at once);
  2. schedule: speculation proposes drafts, the scheduler picks this step's tokens;
  3. run: the model computes the batch (grammar masks computed beside it);
  4. outputs: `engine.output_stage` samples, verifies drafts, forks, appends and
     stop-checks, and returns one `RequestOutput` per request that moved.
`close()` is not needed: the engine owns only memory. The scheduler owns every request's
state; the engine feeds it.

Other threads never wait behind a step for longer than the step in flight: work that must
not race the scheduler goes through the `StepGate` (`run_or_defer` never waits,
`between_steps` waits at most for the step in flight; see `step_gate.py`). `stats()`
never waits either: when a step is running it returns the snapshot taken at the end of
the last one.

KV hand-off: `handoff` (`engine.kv_handoff.KvHandoff`) is the narrow interface
kvtransfer's ports name (`kvtransfer/engine_port.py`): held blocks for export on a
prefill engine, reserved and committed imports on a decode engine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from engine.adapter_ref import AdapterRef
from engine.builder import build_parts
from engine.config import EngineConfig
from engine.decode_roof import DecodeRoof
from engine.engine_stats import StatsSources, collect_stats
from engine.fork import Forker, fork_id
from engine.grammar import LazyGrammarCompiler
from engine.intake import Intake, IntakeParts
from engine.kv_handoff import HandoffParts, HeldKvIndex, KvHandoff
from engine.lora import LoraAdapter
from engine.output_stage import OutputParts, OutputStage, output_of
from engine.precision import WeightQuant
from engine.request import Request, RequestOutput
from engine.request_check import RequestLimits
from engine.request_spec import RequestSpec
from engine.restore_gate import RestoreGate
from engine.sampling_params import MAX_FORKS, SamplingParams
from engine.stats import ClassCounts, EngineStats
from engine.step_gate import StepGate
from engine.step_meter import StepMeter


class LLMEngine:
    """Continuous-batching generation over a paged KV cache with prefix caching."""

    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        self.config = config
        parts = build_parts(config, progress=progress)
        models = parts.models
        self.model_dir, self.spec, self.tokenizer = models.model_dir, models.spec, models.tokenizer
        self.model, self.max_model_len = models.model, models.max_model_len
        self.layout, self.kv_cache, self.pool = parts.layout, parts.kv_cache, parts.pool
        self.scheduler, self.loras, self.offload = parts.scheduler, parts.loras, parts.offload
        self.runner, self.stop_checker = parts.runner, parts.stop_checker
        self.speculator = parts.speculator
        #: The prefix hashes this engine holds, pool and offload tier (thread-safe).
        self.residency = parts.residency
        self.scheduler.on_retire = self._let_go
        self.gate = StepGate()
        self.lock = self.gate.lock  # held for a whole step
        self._meter = StepMeter(self._roof())
        if self.offload is not None:
            gate = RestoreGate(config.kv_restore, self.offload, self._meter, config.block_size)
            self.scheduler.restore_pays = gate.pays
        self.grammars = LazyGrammarCompiler(self.tokenizer, self.spec.vocab_size)
        self.intake = Intake(
            IntakeParts(self._limits(), self.spec.fingerprint, self.loras, self.grammars,
                        self.scheduler.requests)
        )  # fmt: skip
        held = HeldKvIndex()
        forker = Forker(
            self.scheduler, self.pool, self.kv_cache,
            lambda guided: self.grammars().matcher(guided), self.loras.retain,
        )  # fmt: skip
        self.outputs = OutputStage(
            OutputParts(self.scheduler, self.stop_checker, parts.eos_ids, forker, held,
                        self.speculator, self._meter, self.spec.vocab_size)
        )  # fmt: skip
        self.handoff = KvHandoff(
            HandoffParts(self.kv_cache, self.gate, self.scheduler, held, self.intake,
                         self.outputs.committed)
        )  # fmt: skip
        self._held = held
        self._last_stats = self._collect_stats()

    def _roof(self) -> DecodeRoof:
        quantized = self.config.quantization is WeightQuant.INT8
        element = 1 if quantized else self.config.torch_dtype.itemsize
        return DecodeRoof.for_engine(
            self.spec, element, self.layout.bytes_per_token, self.config.memory_bandwidth_gb_s,
            self.config.torch_device,
        )  # fmt: skip

    def _limits(self) -> RequestLimits:
        capacity = self.pool.num_blocks * self.config.block_size
        return RequestLimits(self.max_model_len, self.spec.vocab_size, capacity)

    def _let_go(self, req: Request) -> None:
        """A request left the scheduler: its adapter is no longer held for it."""
        if req.lora is not None:
            self.loras.release(req.lora)
            req.lora = None

    @property
    def kv_blocks(self) -> torch.Tensor:
        """The pool as [num_blocks, bytes_per_block] bytes: what KV transfer moves."""
        return self.kv_cache.blocks

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every live request by id, in any state (read-only: the scheduler owns them)."""
        return self.scheduler.requests

    # -- intake ------------------------------------------------------------------
    def add_request(self, spec: RequestSpec, *, hold_kv: bool = False) -> str:
        """Check and queue a request; returns its id. Thread-safe, never blocks on a step.
        Raises InvalidRequestError naming the field and limit (`engine.request_check`),
        and for `spec.adapter` UnknownAdapterError, AdapterFormatError,
        AdaptersBusyError, or AdapterMismatchError when its digest is not the one asked
        for. With `hold_kv` (a prefill worker's request) the request finishes with its
        blocks pinned for export (`handoff`)."""
        with self.intake.admit(spec, hold_kv=hold_kv) as req:
            self.intake.claim_id(req.request_id)
            self.intake.queue(req)
        return req.request_id

    def load_adapter(self, adapter: AdapterRef) -> None:
        """Make `adapter` resident ahead of its request (from any thread; raises what
        `add_request` would for it). A worker calls it off its event loop, so that reading
        an adapter from disk never blocks the loop's other streams; the request then
        finds it resident (unless evicted meanwhile: then it is read again)."""
        self.loras.release(self.loras.acquire(adapter.name, adapter.digest))

    def abort(self, request_id: str) -> None:
        """Cancel a request in any state; its blocks are freed at the start of the next step
        (an import's once its bytes have landed, see `Scheduler.abort`)."""
        self.intake.queue_abort(request_id)

    def hash_seed_for(self, cache_salt: str = "", lora: LoraAdapter | None = None) -> int:
        """The seed of a request's prefix-cache keys (the router computes the same)."""
        return self.intake.hash_seed_for(cache_salt, lora)

    # -- stepping ----------------------------------------------------------------
    def has_unfinished(self) -> bool:
        if self.intake.pending():
            return True
        return self.gate.has_deferred() or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One intake + schedule + run + outputs pass. Call from a single thread."""
        with self.lock:
            started = time.perf_counter()
            outputs = self._take_intake()
            outputs += self._schedule_and_run()
            self._meter.stop(time.perf_counter() - started)
            # No snapshot here: between steps `stats()` takes a fresh one, and the next
            # step takes its own before it runs (`_schedule_and_run`).
            return self.outputs.forget_ended(outputs)

    def _take_intake(self) -> list[RequestOutput]:
        # Deferred calls first: releases free blocks and commits queue imports before
        # this step schedules.
        self.gate.run_deferred()
        adds, aborts = self.intake.take()
        for req in adds:
            self.scheduler.add(req)
        outputs = self.outputs.take_pending()
        for rid in aborts:
            outputs.extend(self._abort_now(rid))
        return outputs

    def _abort_now(self, request_id: str) -> list[RequestOutput]:
        """Abort a request and its forks (an id of a group ends every fork)."""
        self._held.withdraw(request_id)  # before its blocks may be handed out again
        ids = [request_id, *(fork_id(request_id, i) for i in range(1, MAX_FORKS))]
        return [output_of(req, []) for rid in ids if (req := self.scheduler.abort(rid))]

    def _schedule_and_run(self) -> list[RequestOutput]:
        if self.speculator.enabled:
            self.speculator.propose(
                [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
            )
        batch = self.scheduler.schedule()
        outputs = [output_of(req, []) for req in batch.expired]
        if batch.empty:
            return outputs
        self._meter.count(batch)  # before `advance` moves the requests on
        # The snapshot readers get while this step runs: its prefill tokens still to do.
        self._last_stats = self._collect_stats()
        masks = self.outputs.start_masks(batch)
        result = self.runner.execute(batch)
        for req, n in batch.items:
            if not req.draft_token_ids:  # a verification advances by what it keeps
                self.scheduler.advance(req, n)
        outputs += self.outputs.process(
            result.logits, result.sampling_requests, result.speculating, masks
        )
        return outputs

    # -- observability -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """Current counts, or those at the start of the step that is running (its
        prefill tokens not yet computed). Requests added since, not yet in the
        scheduler, count in `waiting_tokens_by_class` too."""
        if self.lock.acquire(blocking=False):
            try:
                self._last_stats = self._collect_stats()
            finally:
                self.lock.release()
        arriving = self.intake.arriving()
        if not any(arriving):
            return self._last_stats
        queued = self._last_stats.waiting_tokens_by_class
        total = ClassCounts(*(a + b for a, b in zip(queued, arriving, strict=True)))
        return replace(self._last_stats, waiting_tokens_by_class=total)

    def _collect_stats(self) -> EngineStats:
        return collect_stats(
            StatsSources(self.pool, self.scheduler, self._meter, self.layout,
                         self.speculator, self.loras, self.offload)
        )  # fmt: skip

    # -- convenience for tests, benchmarks and the CLI ----------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        adapters: Sequence[str | None] | None = None,
    ) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids.
        `adapters` names each prompt's LoRA adapter (None: the base model)."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        names = adapters if adapters is not None else [None] * len(prompts)
        ids = [
            self.add_request(RequestSpec(p, s, adapter=None if a is None else AdapterRef(a)))
            for p, s, a in zip(prompts, params, names, strict=True)
        ]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
