"""The engine: one model, one paged KV pool, one scheduler; the API the workers call.

Lifecycle: `LLMEngine(config)` resolves the model (converting the default one on first
use), loads weights, sizes the KV pool from the memory budget and logs it. Callers then
`add_request` / `abort` from any thread (they only queue; a request may carry a priority
class and a deadline, see `scheduler.py`), and one thread calls `step()`
in a loop while `has_unfinished()`; each step first runs deferred calls, then applies
queued adds and aborts (freeing those requests' blocks at once), then schedules, runs the
model, samples and returns per-request outputs. `close()` is not needed: the engine owns
only memory. The scheduler owns every request's state; the engine feeds it.

Other threads never wait behind a step for longer than the step in flight: work that must
not race the scheduler goes through the `StepGate` (`run_or_defer` never waits,
`between_steps` waits at most for the step in flight; see `step_gate.py`). `stats()`
never waits either: when a step is running it returns the snapshot taken at the end of
the last one.

KV hand-off, the narrow interface kvtransfer's ports name (`kvtransfer/engine_port.py`):
a prefill engine finishes a request added with `hold_kv=True` and keeps its blocks pinned
(HELD_FOR_EXPORT) until `release_held`; `held_kv` describes them without the step lock,
and `release_held` never waits (both run on a prefill worker's event loop). A decode
engine reserves blocks with `reserve_import` (WAITING_FOR_REMOTE_KV), has them filled
from outside, then `commit_import` makes the request join the batch as if it had
prefilled here, or `cancel_import` frees them; these wait at most for the step in flight.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from engine.attention import select_backend
from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.draft_model import DraftModel
from engine.errors import InvalidRequestError
from engine.fork import Forker, fork_id
from engine.fused_decode import DecodeKernel, fused_decode_wanted
from engine.grammar import GrammarCompiler, MaskJob
from engine.kv_cache import KvCache, KvLayout, blocks_for_budget
from engine.kv_handoff import HeldKv, HeldKvIndex, ImportSlot
from engine.kv_offload import OffloadTier
from engine.linear_kernel import pick_linear_kernel
from engine.llama import LlamaModel
from engine.logits_processing import RowContext
from engine.logprobs import TokenLogprobs, token_logprobs
from engine.lora import AdapterRef, LoraAdapter, LoraTarget
from engine.lora_set import LoraSet
from engine.model_runner import ModelRunner
from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from engine.precision import kv_storage_dtype
from engine.prefix_hash import hash_seed
from engine.priority import Priority
from engine.request import FinishReason, Request, RequestOutput, RequestStatus
from engine.sampler import new_generator, sample
from engine.sampling_params import MAX_FORKS, SamplingParams
from engine.scheduled_batch import ScheduledBatch
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculation import SpecMode, Speculator, accepted
from engine.stats import ClassCounts, EngineStats
from engine.step_gate import StepGate
from engine.step_meter import StepMeter, prefill_backlog
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching generation over a paged KV cache with prefix caching."""

    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(
            config.model, config.model_cache_dir.expanduser(), progress=progress
        )
        quant = config.quantization
        self.spec = ModelSpec.from_dir(self.model_dir).with_weights(quant.value)
        self.tokenizer = Tokenizer(self.model_dir)
        device, dtype = config.torch_device, config.torch_dtype
        kernel = pick_linear_kernel(config.linear_kernel, device, dtype, quant)
        log.info("linear layers: %s kernel (%s, %s, weights %s)", kernel.name, device, dtype, quant)
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
        fused = fused_decode_wanted(config.decode_kernel, device, dtype, quant, kv_dtype)
        self.model = LlamaModel(self.spec, dtype, device, kernel, fused=fused)
        self.model.load_weights(self.model_dir, progress=progress)
        if config.decode_kernel is DecodeKernel.FUSED and self.model.fused is None:
            raise RuntimeError("decode_kernel fused: its kernel failed to compile (see above)")
        if self.model.fused is not None:
            log.info("decode-only steps of 1-%d sequences: fused kernel", self.model.fused.max_rows)
        else:
            log.info("decode: torch forward")
        self.layout = KvLayout.from_spec(self.spec, kv_dtype, config.block_size, device)
        num_blocks = config.num_kv_blocks or blocks_for_budget(self.layout, config.kv_cache_bytes)
        self.kv_cache = KvCache(self.layout, num_blocks, device)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.block_size, config.max_num_seqs, config.max_num_batched_tokens),
            self.pool,
        )
        self.loras = self._lora_set(config)
        self.scheduler.on_retire = self._let_go
        self.offload: OffloadTier | None = None
        if config.kv_offload_bytes:
            self.offload = OffloadTier(self.kv_cache, config.kv_offload_bytes)
            self.pool.on_evict = self.offload.spill
            self.scheduler.tier = self.offload
        backend = select_backend(
            config.attention_backend,
            device,
            dtype,
            quantized_kv=self.layout.quantized,
            # Where the fused decode runs, larger decode steps use its attention too.
            compiled_decode=self.model.fused is not None,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, backend, config.block_size)
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
        )
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stop_checker = StopChecker(self.tokenizer, eos, self.max_model_len)
        self._eos_ids = frozenset(eos)
        self.gate = StepGate()
        self.lock = self.gate.lock  # held for a whole step
        self._held = HeldKvIndex()
        # `_inbox_lock` only guards the queues, so add/abort never wait for a step.
        self._inbox_lock = threading.Lock()
        self._inbox_add: list[Request] = []
        self._inbox_abort: list[str] = []
        self._meter = StepMeter()
        self._grammars: GrammarCompiler | None = None
        self._forker = Forker(
            self.scheduler, self.pool, self.kv_cache, config.block_size,
            lambda spec: self.grammars().matcher(spec), self.loras.retain,
        )  # fmt: skip
        self._pending: list[RequestOutput] = []  # forks ended at an import's commit
        self.speculator = Speculator(config.spec_config, self._draft_model(config))
        self._last_stats = self._collect_stats()
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token), model %s",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * self.layout.bytes_per_block / 2**20,
            self.layout.bytes_per_token,
            self.model_dir,
        )

    def _draft_model(self, config: EngineConfig) -> DraftModel | None:
        """The draft model speculation asks, when one is named and speculation is on."""
        if config.spec_draft_model is None or config.speculative_decoding is SpecMode.OFF:
            return None
        cache = config.model_cache_dir.expanduser()
        return DraftModel(
            resolve_model_dir(config.spec_draft_model, cache, progress=False),
            self.tokenizer, dtype=config.torch_dtype, device=config.torch_device,
            block_size=config.block_size, kv_cache_bytes=config.spec_draft_kv_cache_bytes,
        )  # fmt: skip

    def _lora_set(self, config: EngineConfig) -> LoraSet:
        """The adapters of `--lora-dir`, read onto this model's projections."""
        target = LoraTarget(
            self.spec, config.torch_dtype, config.torch_device, config.max_lora_rank,
            dict(self.model.folded_gains),
        )  # fmt: skip
        directory = None if config.lora_dir is None else Path(config.lora_dir).expanduser()
        return LoraSet(directory, config.max_loras, target)

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

    # -- request intake ----------------------------------------------------------
    def hash_seed_for(self, cache_salt: str = "", lora: LoraAdapter | None = None) -> int:
        return hash_seed(self.spec.fingerprint, cache_salt, "" if lora is None else lora.digest)

    def validate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequestError naming the field and limit; changes nothing."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        self._check_ids("prompt_token_ids", prompt_token_ids)
        vocab = self.spec.vocab_size
        if any(t >= vocab for t, _ in sampling.logit_bias):
            raise InvalidRequestError("logit_bias", f"each token id must be < {vocab}")
        if any(t >= vocab for t in sampling.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"each id must be < {vocab}")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {n} tokens; must be < the context length {self.max_model_len}"
            )
        if n + sampling.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n}) + max_tokens must be <= the context length {self.max_model_len}",
                sampling.max_tokens,
            )
        capacity = self.pool.num_blocks * self.config.block_size
        if n + sampling.n * sampling.max_tokens > capacity:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n}) + n x max_tokens must fit the KV pool ({capacity} tokens)",
            )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str = "",
        hold_kv: bool = False,
        priority: Priority = Priority.STANDARD,
        deadline: float | None = None,
        resume_token_ids: Sequence[int] = (),
        adapter: AdapterRef | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Thread-safe, never blocks on a step.
        `priority` orders admission and preemption; past `deadline` (time.monotonic()
        seconds) a preempted request ends with FinishReason.DEADLINE, not recomputed.
        `resume_token_ids` are output tokens another engine already produced (a stream
        migrated after its worker died): the request continues after them as if this
        engine had made them (`_resume`). `adapter` names a LoRA adapter of `--lora-dir`
        (UnknownAdapterError, AdapterFormatError, AdaptersBusyError, or
        AdapterMismatchError when its digest is not the one asked for)."""
        self.validate(prompt_token_ids, sampling)
        with self._adapter_held(adapter) as lora:
            req = self._new_request(
                request_id, prompt_token_ids, sampling, cache_salt, hold_kv, lora
            )
            req.priority, req.deadline = _priority(priority), deadline
            if resume_token_ids:
                self._resume(req, resume_token_ids)
            self._claim_id(req.request_id)
            with self._inbox_lock:
                self._inbox_add.append(req)
        return req.request_id

    def load_adapter(self, adapter: AdapterRef) -> None:
        """Make `adapter` resident ahead of its request (from any thread; raises what
        `add_request` would for it). A worker calls it off its event loop, so that reading
        an adapter from disk never blocks the loop's other streams; the request then
        finds it resident (unless evicted meanwhile: then it is read again)."""
        self.loras.release(self.loras.acquire(adapter.name, adapter.digest))

    @contextlib.contextmanager
    def _adapter_held(self, adapter: AdapterRef | None) -> Iterator[LoraAdapter | None]:
        """The adapter, held for the request the block builds and queues (None: the base
        model); if the block raises, it is let go again."""
        if adapter is None:
            yield None
            return
        lora = self.loras.acquire(adapter.name, adapter.digest)
        try:
            yield lora
        except BaseException:
            self.loras.release(lora)
            raise

    def _check_ids(self, field: str, ids: Sequence[int]) -> None:
        """InvalidRequestError naming `field` unless every id is in the vocabulary."""
        vocab = self.spec.vocab_size
        if any(not (0 <= t < vocab) for t in ids):
            raise InvalidRequestError(field, f"each id must be in [0, {vocab})")

    def _resume(self, req: Request, output: Sequence[int]) -> None:
        """Make `req` continue after `output`: it is queued as a preempted request is,
        with its output so far, so its first step computes the KV of prompt + output and
        samples the next token. Penalties, min_tokens, stop checks and max_tokens count
        that output, the grammar is advanced through it, and a seeded request's next draw
        is keyed on its position (`Request.draw_generator`): greedy and seeded streams go
        on exactly as one engine would have run them."""
        params = req.sampling
        self._check_ids("resume_token_ids", output)
        if len(output) >= params.max_tokens:
            raise InvalidRequestError(
                "resume_token_ids", f"must hold fewer than max_tokens ({params.max_tokens}) ids"
            )
        if params.n != 1 or params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "resume_token_ids", "only a request with n = 1 and no prompt_logprobs resumes"
            )
        req.output_token_ids = list(output)
        if req.grammar is not None:
            req.grammar.advance(output)

    def abort(self, request_id: str) -> None:
        """Cancel a request in any state; its blocks are freed at the start of the next step
        (an import's once its bytes have landed, see `Scheduler.abort`)."""
        with self._inbox_lock:
            self._inbox_abort.append(request_id)

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler, built on first use (it indexes the vocabulary)."""
        with self._inbox_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.of(self.tokenizer, self.spec.vocab_size)
            return self._grammars

    def _new_request(
        self,
        request_id: str | None,
        prompt: Sequence[int],
        sampling: SamplingParams,
        cache_salt: str,
        hold_kv: bool,
        lora: LoraAdapter | None = None,
    ) -> Request:
        grammar = None if sampling.guided is None else self.grammars().matcher(sampling.guided)
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=list(prompt),
            sampling=sampling,
            hash_seed=self.hash_seed_for(cache_salt, lora),
            lora=lora,
            hold_kv=hold_kv,
            generator=None if sampling.greedy else new_generator(sampling.seed),
            grammar=grammar,
        )

    def _claim_id(self, request_id: str) -> None:
        """Refuse an id that a live request already has (queued or in any state)."""
        with self._inbox_lock:
            queued = any(r.request_id == request_id for r in self._inbox_add)
        if queued or request_id in self.scheduler.requests:
            raise InvalidRequestError(
                "request_id", "must be unique among live requests", request_id
            )

    # -- KV hand-off ---------------------------------------------------------------
    def held_kv(self, request_id: str) -> HeldKv:
        """The pinned blocks of a finished hold_kv request; UnknownRequestError if none.
        Never waits for a step."""
        return self._held.get(request_id)

    def release_held(self, request_id: str) -> bool:
        """Unpin an exported request's blocks (full ones stay cached); False if not held.

        Never waits for a step: the blocks are freed now if none is running, else first
        thing in the next one.
        """
        if not self._held.withdraw(request_id):
            return False
        self.gate.run_or_defer(lambda: self._unpin(request_id))
        return True

    def _unpin(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    def reserve_import(
        self,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        sampling: SamplingParams,
        *,
        request_id: str,
        cache_salt: str = "",
        priority: Priority = Priority.STANDARD,
        deadline: float | None = None,
        fork_token_ids: Sequence[int] = (),
        resume_token_ids: Sequence[int] = (),
        adapter: AdapterRef | None = None,
    ) -> ImportSlot:
        """Reserve blocks for a prompt whose KV comes from elsewhere (reusing cached prefix
        blocks); OutOfBlocksError if short, InvalidRequestError for a bad request. With
        n > 1, `fork_token_ids` are forks 1..n-1's first tokens: the commit forks them.
        `priority` and `deadline` as for `add_request`, once the import is committed.
        `resume_token_ids`: a migrated stream's tokens so far (`_resume`); they replace
        `first_token_id` (the exporter's own draw, which an unseeded sample may not
        repeat), and the first step after the commit computes their KV after the
        imported prompt's. `adapter` as for `add_request`: its digest is the exporter's,
        so KV computed with another copy of the adapter is refused."""
        self.validate(prompt_token_ids, sampling)
        vocab = self.spec.vocab_size
        if not 0 <= first_token_id < vocab:
            raise InvalidRequestError("first_token_id", f"must be in [0, {vocab})")
        with self._adapter_held(adapter) as lora:
            req = self._new_request(request_id, prompt_token_ids, sampling, cache_salt, False, lora)
            return self._reserve(
                req, first_token_id, priority, deadline, fork_token_ids, resume_token_ids
            )

    def _reserve(
        self,
        req: Request,
        first_token_id: int,
        priority: Priority,
        deadline: float | None,
        fork_token_ids: Sequence[int],
        resume_token_ids: Sequence[int],
    ) -> ImportSlot:
        sampling, request_id = req.sampling, req.request_id
        req.priority, req.deadline = _priority(priority), deadline
        if resume_token_ids:
            self._resume(req, resume_token_ids)
        else:
            req.output_token_ids.append(first_token_id)
            if req.grammar is not None:  # the prefill worker sampled it under this grammar
                req.grammar.advance([first_token_id])
        if len(fork_token_ids) != sampling.n - 1:
            raise InvalidRequestError("fork_token_ids", f"must hold n - 1 = {sampling.n - 1} ids")
        req.fork_token_ids = list(fork_token_ids)

        def reserve() -> ImportSlot:
            self._claim_id(request_id)
            cached = self.scheduler.reserve_import(req)
            return ImportSlot(request_id, list(req.block_ids), cached)

        return self.gate.between_steps(reserve)

    def commit_import(self, request_id: str) -> FinishReason | None:
        """The reserved blocks now hold the prompt's KV: queue the request to decode.

        Returns None when it was queued, else why it already ended, its blocks freed: the
        first token ended it (STOP for EOS or a stop, LENGTH for max_tokens or the context
        length), or it was aborted while its bytes landed (ABORT). UnknownRequestError if
        `request_id` is not importing.
        """
        return self.gate.between_steps(lambda: self._commit(request_id))

    def _commit(self, request_id: str) -> FinishReason | None:
        req = self.scheduler.commit_import(request_id)
        if req is None:
            return FinishReason.ABORT
        req.forked = True
        for index, token in enumerate(req.fork_token_ids, start=1):
            fork = self._forker.spawn(req, index, [token])
            ended = self.stop_checker.check(fork)
            if ended is not None:  # its first token (sent from prefill) already ended it
                self.scheduler.finish(fork, ended)
                self._pending.append(self._output(fork, []))
        reason = self.stop_checker.check(req)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return reason

    def cancel_import(self, request_id: str) -> bool:
        """Free a reservation whose transfer failed or was cancelled; False if none."""
        return self.gate.between_steps(lambda: self.scheduler.cancel_import(request_id))

    # -- stepping ----------------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self._inbox_lock:
            if self._inbox_add or self._inbox_abort:
                return True
        return self.gate.has_deferred() or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One scheduling + model step. Call from a single thread."""
        with self.lock:
            started = time.perf_counter()
            outputs = self._run_batch(self._drain_inbox())
            self._meter.stop(time.perf_counter() - started)
            # No snapshot here: between steps `stats()` takes a fresh one, and the next
            # step takes its own before it runs (`_run_batch`).
            return outputs

    def _run_batch(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.speculator.enabled:
            self.speculator.propose(
                [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
            )
        batch = self.scheduler.schedule()
        outputs.extend(self._output(req, []) for req in batch.expired)
        if batch.empty:
            return self._forget_ended(outputs)
        self._meter.count(batch)  # before `advance` moves the requests on
        # The snapshot readers get while this step runs: its prefill tokens still to do.
        self._last_stats = self._collect_stats()
        masks = self._start_masks(batch)
        result = self.runner.execute(batch)
        for req, n in batch.items:
            if not req.draft_token_ids:  # a verification advances by what it keeps
                self.scheduler.advance(req, n)
        plain = len(result.sampling_requests)
        if plain:
            self._meter.sampled(plain)
            outputs.extend(self._sample(result.logits[:plain], result.sampling_requests, masks))
        if result.speculating:
            outputs.extend(self._verify(result.logits[plain:], result.speculating))
        return self._forget_ended(outputs)

    def _forget_ended(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.speculator.states:
            for out in outputs:
                if out.finished:
                    self.speculator.forget(out.request_id)
        return outputs

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
            logits, [r.params for r in rows], generators, contexts=rows, eos_ids=self._eos_ids
        )
        outputs, at = [], 0
        for req in reqs:
            drafts, req.draft_token_ids = req.draft_token_ids, []
            tokens = accepted(samples[at : at + len(drafts) + 1], drafts)
            at += len(drafts) + 1
            self.speculator.record(req, len(drafts), len(tokens) - 1)
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
            reason = self.stop_checker.check(req)
            if reason is not None:
                break
        self._meter.sampled(len(kept))
        self.scheduler.advance(req, req.num_tokens - 1 - req.num_computed_tokens)
        self.scheduler.trim_drafts(req)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return self._output(req, kept)

    def _start_masks(self, batch: ScheduledBatch) -> tuple[MaskJob, list[Request]] | None:
        """Start the grammar masks of this step's constrained sampling rows, to compute
        while the model runs; None when no row is constrained."""
        rows = [
            req
            for req, n in batch.items
            if req.grammar is not None and req.num_computed_tokens + n == req.num_tokens
        ]
        if not rows:
            return None
        return MaskJob(
            [r.grammar for r in rows if r.grammar is not None], self.spec.vocab_size
        ), rows

    def _sample(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        masks: tuple[MaskJob, list[Request]] | None,
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
            contexts=contexts, eos_ids=self._eos_ids, allowed=allowed,
        )  # fmt: skip
        asked = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
        scored: dict[int, TokenLogprobs] = {}
        if asked:
            values = token_logprobs(
                logits[torch.tensor(asked)],
                [tokens[i] for i in asked],
                [reqs[i].sampling.logprobs or 0 for i in asked],
            )
            scored = dict(zip(asked, values, strict=True))
        # Forks sampled on a prefill engine first: their tokens ride on their parent's output.
        for i, req in enumerate(reqs):
            if req.request_id not in self.scheduler.requests and req.group_id:
                parent = reqs[parent_row[i]]
                parent.fork_token_ids.append(tokens[i])
                if i in scored:
                    parent.fork_logprobs.append(scored[i])
        return [
            self._append_token(req, token, scored.get(i))
            for i, (req, token) in enumerate(zip(reqs, tokens, strict=True))
            if req.request_id in self.scheduler.requests
        ]

    def _with_forks(self, reqs: list[Request]) -> tuple[list[Request], list[int]]:
        """The rows plus the forks of requests with n > 1 about to sample their first
        token, and each row's logits row (a fork samples from its parent's)."""
        rows, parent_row = list(reqs), list(range(len(reqs)))
        for i, req in enumerate(reqs):
            if req.sampling.n == 1 or req.forked or req.group_id or req.output_token_ids:
                continue
            req.forked = True
            for index in range(1, req.sampling.n):
                if req.hold_kv:  # prefill: sampled only, the decode engine forks
                    rows.append(self._forker.sampled_only(req, index))
                else:
                    rows.append(self._forker.spawn(req, index, []))
                parent_row.append(i)
        return rows, parent_row

    def _drain_inbox(self) -> list[RequestOutput]:
        # Deferred calls first: releases free blocks and commits queue imports before
        # this step schedules.
        self.gate.run_deferred()
        with self._inbox_lock:
            adds, self._inbox_add = self._inbox_add, []
            aborts, self._inbox_abort = self._inbox_abort, []
        for req in adds:
            self.scheduler.add(req)
        outputs, self._pending = self._pending, []
        for rid in aborts:
            outputs.extend(self._abort_now(rid))
        return outputs

    def _abort_now(self, request_id: str) -> list[RequestOutput]:
        """Abort a request and its forks (an id of a group ends every fork)."""
        self._held.withdraw(request_id)  # before its blocks may be handed out again
        ids = [request_id, *(fork_id(request_id, i) for i in range(1, MAX_FORKS))]
        return [self._output(req, []) for rid in ids if (req := self.scheduler.abort(rid))]

    def _append_token(
        self, req: Request, token: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        first = req.first_token_time is None
        if first:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token)
        if req.grammar is not None:
            req.grammar.advance([token])
        reason = self.stop_checker.check(req)
        if reason is not None:
            self.scheduler.finish(req, reason)
            if req.status is RequestStatus.HELD_FOR_EXPORT:
                self._held.publish(HeldKv.of(req))
        out = self._output(req, [token])
        prompt = tuple(req.prompt_logprobs) if first else ()
        if logprobs is None and not prompt:
            return out
        return replace(out, logprobs=(logprobs,) if logprobs else (), prompt_logprobs=prompt)

    @staticmethod
    def _output(req: Request, new_tokens: list[int]) -> RequestOutput:
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
        with self._inbox_lock:
            arriving = prefill_backlog(self._inbox_add)
        if not any(arriving):
            return self._last_stats
        queued = self._last_stats.waiting_tokens_by_class
        total = ClassCounts(*(a + b for a, b in zip(queued, arriving, strict=True)))
        return replace(self._last_stats, waiting_tokens_by_class=total)

    def _collect_stats(self) -> EngineStats:
        p = self.pool.stats()
        sched = self.scheduler
        held_blocks, importing_blocks = sched.handoff_blocks()
        m = self._meter
        lora = self.loras.counts()
        return EngineStats(
            total_blocks=p.total,
            free_blocks=p.free,
            used_blocks=p.used,
            cached_blocks=p.cached,
            held_blocks=held_blocks,
            importing_blocks=importing_blocks,
            running=len(sched.running),
            waiting=len(sched.waiting),
            held_requests=len(sched.held),
            importing_requests=len(sched.importing),
            prefix_hit_tokens=sched.prefix_hit_tokens,
            prefix_query_tokens=sched.prefix_query_tokens,
            num_preemptions=sched.num_preemptions,
            waiting_by_class=ClassCounts.of(r.priority for r in sched.waiting),
            running_by_class=ClassCounts.of(r.priority for r in sched.running),
            preemptions_by_class=ClassCounts(*sched.preemptions_by_class),
            waiting_tokens_by_class=prefill_backlog(sched.waiting, sched.running),
            prefill_tokens_total=m.prefill_tokens,
            prefill_busy_s_total=m.prefill_busy_s,
            decode_tokens_total=m.decode_tokens,
            decode_steps_total=m.decode_steps,
            decode_busy_s_total=m.decode_busy_s,
            busy_s_total=m.busy_s,
            kv_bytes_per_token=self.layout.bytes_per_token,
            kv_pool_bytes=p.total * self.layout.bytes_per_block,
            block_size=self.config.block_size,
            spec_drafted_total=self.speculator.drafted_total,
            spec_accepted_total=self.speculator.accepted_total,
            spec_verifications_total=self.speculator.verifications_total,
            lora_resident=lora.resident,
            lora_held=lora.held,
            lora_loads_total=lora.loads,
            lora_evictions_total=lora.evictions,
            **self._offload_stats(),
        )

    def _offload_stats(self) -> dict[str, int]:
        if self.offload is None:
            return {}
        o = self.offload.stats()
        return {
            "offload_blocks": o.blocks,
            "offload_capacity_blocks": o.capacity_blocks,
            "offload_hit_tokens": self.scheduler.offload_hit_tokens,
            "offload_spilled_total": o.spilled,
            "offload_restored_total": o.restored,
        }

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
            self.add_request(p, s, adapter=None if a is None else AdapterRef(a))
            for p, s, a in zip(prompts, params, names, strict=True)
        ]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]


def _priority(value: int) -> Priority:
    """`value` (a Priority or its value) as a Priority; else InvalidRequestError."""
    try:
        return Priority(value)
    except ValueError:
        allowed = ", ".join(f"{p.label} ({p.value})" for p in Priority)
        raise InvalidRequestError("priority", f"must be one of {allowed}", value) from None
